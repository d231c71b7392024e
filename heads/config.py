"""What a head is (`HeadConfig`, saved beside its weights) and what it answers (`HeadResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

HEAD_TYPES = ("classify", "count", "detect", "binary")
POOLINGS = ("last", "mean", "attention", "slots", "dense")
DEFAULT_SCORE_THRESHOLD = 0.5  # detect, before calibration (train/calibrate.py) picks one from the data


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head; stored as `<name>.json` next to `<name>.safetensors`.

    type:        "classify" (one label of `labels`), "count" (an integer 0..max_count),
                 "detect" (up to `max_boxes` boxes of the queried class), "binary" (yes / no).
    hidden_size: width D of the language model's final hidden states.
    labels:      classify: the label set (required, at least two, unique); detect: optional
                 name(s) of the class the head finds; unused by count and binary.
    max_count:   count: classes 0..max_count; the last class means "max_count or more".
    max_boxes:   detect: box slots predicted per input.
    pooling:     how [B, T, D] becomes [B, D]: "attention" (a learned query over the real
                 tokens), "last" (the last real token), "mean" (mean of the real tokens);
                 detect also "slots": a learned query per box slot, each slot reading its own
                 tokens (one pooled vector cannot say where several objects are); detect also
                 "dense": no pooling, every visual token scores and boxes what its cell holds
                 (`DenseDetectHead`; needs the tokens' cell centres). None: dense for detect,
                 attention otherwise.
    dropout:     on the pooled feature, training only.
    score_threshold: detect: a slot is reported as a box when its score exceeds this (training
                 calibrates it on the train split unless told not to, train/calibrate.py).
    dense_width: dense detect: width of the hidden layer each token goes through (0: linear).
    """

    type: str
    hidden_size: int
    labels: list[str] | None = None
    max_count: int = 8
    max_boxes: int = 8
    pooling: str | None = None
    dropout: float = 0.0
    score_threshold: float = DEFAULT_SCORE_THRESHOLD
    dense_width: int = 256

    def __post_init__(self) -> None:
        if self.type not in HEAD_TYPES:
            hint = " ('lm' means no task head: answers come from the LM head)" if self.type == "lm" else ""
            raise ValueError(f"HeadConfig.type={self.type!r}: must be one of {list(HEAD_TYPES)}{hint}")
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"HeadConfig.hidden_size={self.hidden_size!r}: must be a positive int "
                             "(the language model's hidden width)")
        if self.pooling is None:
            self.pooling = "dense" if self.type == "detect" else "attention"
        if self.pooling not in POOLINGS:
            raise ValueError(f"HeadConfig.pooling={self.pooling!r}: must be one of {list(POOLINGS)}")
        if self.pooling in ("slots", "dense") and self.type != "detect":
            raise ValueError(f"HeadConfig.pooling={self.pooling!r} is for type='detect' (box slots, or boxes "
                             f"per visual token), not {self.type!r}")
        if isinstance(self.dense_width, bool) or not isinstance(self.dense_width, int) or self.dense_width < 0:
            raise ValueError(f"HeadConfig.dense_width={self.dense_width!r}: must be an int >= 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"HeadConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if not 0.0 < self.score_threshold < 1.0:
            raise ValueError(f"HeadConfig.score_threshold={self.score_threshold!r}: must be in (0, 1)")
        for name in ("max_count", "max_boxes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadConfig.{name}={value!r}: must be an int >= 1")
        self._check_labels()

    def _check_labels(self) -> None:
        labels = self.labels
        if labels is None:
            if self.type == "classify":
                raise ValueError("HeadConfig.labels is required for type='classify': "
                                 "a list of at least two distinct label strings")
            return
        if isinstance(labels, str) or not all(isinstance(x, str) for x in labels):
            raise ValueError(f"HeadConfig.labels={labels!r}: must be a list of strings")
        labels = list(labels)
        if len(set(labels)) != len(labels):
            dupes = sorted({x for x in labels if labels.count(x) > 1})
            raise ValueError(f"HeadConfig.labels: duplicate labels {dupes}")
        if self.type == "classify" and len(labels) < 2:
            raise ValueError(f"HeadConfig.labels={labels!r}: type='classify' needs at least two labels")
        if self.type in ("count", "binary"):
            raise ValueError(f"HeadConfig.labels: not used by type={self.type!r}; "
                             "set it to None (labels apply to 'classify' and 'detect')")
        if self.type == "detect" and not labels:
            raise ValueError("HeadConfig.labels=[]: for type='detect' give the class name(s) or None")
        self.labels = labels  # a tuple from a config system becomes a plain list, JSON-friendly

    @property
    def num_outputs(self) -> int:
        """Width of the head's final projection."""
        if self.type == "classify":
            return len(self.labels)
        if self.type == "count":
            return self.max_count + 1
        if self.type == "detect" and self.pooling == "dense":
            return 5  # per visual token: objectness logit + (cx, cy) offsets + (w, h) logits
        if self.type == "detect":
            return self.max_boxes * 5  # per slot: objectness logit + (cx, cy, w, h) logits
        return 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HeadConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"HeadConfig: unknown field(s) {unknown}; valid fields are {sorted(known)}")
        missing = sorted({"type", "hidden_size"} - set(data))
        if missing:
            raise ValueError(f"HeadConfig: missing required field(s) {missing}")
        return cls(**data)


@dataclass(kw_only=True)
class HeadResult:
    """One input's structured answer. Only the fields of the head's type are set.

    classify: label; count: count; detect: boxes (x1, y1, x2, y2) in [0, 1], best first, with
    their scores (and label when the head names one class); binary: answer "yes" / "no".
    confidence: probability of the reported answer (detect: see `DetectHead.decode`).
    """

    type: str
    label: str | None = None
    count: int | None = None
    boxes: list[tuple[float, float, float, float]] | None = None
    scores: list[float] | None = None
    answer: str | None = None
    confidence: float

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.boxes is not None:
            out["boxes"] = [list(b) for b in self.boxes]  # the form JSON gives back
        return out
