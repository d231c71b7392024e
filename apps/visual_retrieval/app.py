"""The retrieval application: each query's image and question go to the adapter its question or
kind routes to (a manifest domain that asked the question, else the manifest's choice for the
kind's task type, the base model when there is none; plan.py), answers are parsed, scored when
known and drawn when they hold boxes.

`heads`: auto answers with a task head where the routed domain has one; never generates text;
always answers every query of a head's kind (ground, count, exists, classify, ...) with a head, and
such a query no head can answer (no domain, a domain without a head, an adapter the server lacks or
a head it refuses) gets an error saying why instead of a generated answer. Captions and QA, whose
lm domains carry no head, are generated in every mode.

    app = RetrievalApp(client, ImageCollection(root), RetrievalConfig(), manifest, out_dir="out")
    app.ask(Query("image_00001.png", "Where is the red car?"))   # one query -> result dict
    app.run_batch(read_queries("queries.jsonl"))                   # results.jsonl + report
    app.interactive(sys.stdin, sys.stdout)                         # "<image> <question>" per line
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, TextIO

from serve.rpc import ServerError

from apps.common.routing import Route, ServerCaps, resolve_route

from .collection import BadImage
from .draw import draw_result
from .fit import GROUNDINGS, fit_image, map_boxes, native_box_size
from .plan import Plan, RouteRefused, always_refusal, plan_query
from .queries import KINDS, Query
from .report import summarise
from .scoring import predict, score

REFUSALS = ("rejected", "unsupported", "bad_argument")
# query kind -> the manifest domain or task type that serves it
DEFAULT_ROUTES = {"ground": "detect", "count": "count", "exists": "binary", "color": "qa", "direction": "qa",
                  "classify": "classify", "caption": "qa", "qa": "qa"}



@dataclass
class RetrievalConfig:
    max_new_tokens: int = 32
    routes: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ROUTES))
    accuracy_target: float = 0.0  # an adapter must reach it on the routed domain to be used
    heads: str = "auto"  # auto | never | always (see apps.common.routing)
    load_adapters: bool = False  # ask the server to load selected adapters it does not serve yet
    concurrency: int = 4  # queries in flight at once in batch mode
    draw: str = "boxes"  # draw results on their images: boxes (queries with boxes) | all | none
    box_scale: str = "auto"
    max_frame_pixels: int = 3840 * 2160  # the server's rpc.max_frame_pixels: larger photos are downscaled to it
    grounding: str = "qwen2_vl"  # how native <|box_start|> boxes are read: qwen2_vl (0-1000) | qwen2_5_vl
    encoding: str = "png"
    request_timeout_s: float = 60.0
    app: str = "visual_retrieval"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.routes) - set(KINDS))
        if unknown:
            raise ValueError(f"routes: unknown query kind(s) {unknown}; kinds: {list(KINDS)}")
        self.routes = {**DEFAULT_ROUTES, **self.routes}
        if self.draw not in ("boxes", "all", "none"):
            raise ValueError(f"draw must be boxes, all or none, got {self.draw!r}")
        if self.grounding not in GROUNDINGS:
            raise ValueError(f"grounding must be one of {GROUNDINGS}, got {self.grounding!r}")
        if self.max_frame_pixels < 1:
            raise ValueError(f"max_frame_pixels must be >= 1, got {self.max_frame_pixels}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


def route_kind(route_name: str) -> str:
    """The query kind of a route name (`RetrievalApp.route_key`: "count", or "count: <question>")."""
    return route_name.split(": ", 1)[0]


class RetrievalApp:
    def __init__(self, client, collection, config: RetrievalConfig | None = None,
                 manifest: dict[str, Any] | None = None, out_dir: str | Path | None = None):
        self.client, self.collection = client, collection
        self.config = config or RetrievalConfig()
        self.manifest = manifest
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.routes: dict[str, Route] = {}
        self.refused: dict[str, str] = {}  # route name -> why heads=always cannot answer on it
        self._plans: dict[tuple[str, str, bool], Plan] = {}  # (question, kind, guessed) -> its plan
        self.mode_switches = 0
        self._caps: ServerCaps | None = None

    def plan(self, query: Query) -> Plan:
        """How the query is routed (plan.py): by a domain that asked its question, else by its kind."""
        key = (query.question, query.kind, query.guessed)
        if key not in self._plans:
            self._plans[key] = plan_query(query, self.config.routes, self.manifest)
        return self._plans[key]

    def prepared(self, query: Query) -> Query:
        """The query as it is answered and scored: asked as its domain's kind where its question or
        `routes` picked a domain with a head. The prepared query keeps the plan that picked it (a qa
        query that routes.qa sent to a classify domain is not re-routed as a classify query)."""
        plan = self.plan(query)
        if plan.kind == query.kind:
            return query
        prepared = replace(query, kind=plan.kind)
        self._plans[(prepared.question, prepared.kind, prepared.guessed)] = plan
        return prepared

    def route_key(self, query: Query) -> str:
        """Which queries share a route: those of one kind, or, where their question picks a domain or
        the kind's task type has domains that record the one question they answer (a head answers
        only its own), those of one kind and question."""
        return self.plan(query).name

    def route(self, query: Query) -> Route:
        plan = self.plan(query)
        if plan.name not in self.routes:
            if self._caps is None:
                try:
                    self._caps = ServerCaps.probe(self.client)
                except Exception:  # a server without list_adapters serves the base model
                    self._caps = ServerCaps()
            load = self.client.load_adapter if self.config.load_adapters else None
            # heads=always is checked below: routing itself gives a head only where the domain has one
            heads = "never" if plan.generated else "auto" if self.config.heads == "always" else self.config.heads
            route = resolve_route(plan.key, self.config.accuracy_target, self.manifest, self._caps, heads, load,
                                  plan.question)
            self.routes[plan.name] = replace(route, via=plan.via)
            if self.config.heads == "always" and always_refusal(route, plan):
                self.refused[plan.name] = always_refusal(route, plan)
        return self.routes[plan.name]

    def _degrade(self, name: str, error: ServerError, sent: Route) -> bool:
        """After a refusal of a request sent on route `sent`: True when there is a route to retry on.
        Queries in flight together share a route; when another one's refusal has already moved it
        on, the retry takes the current route, and the refusal of `sent` is not charged to it."""
        if error.kind not in REFUSALS:
            return False
        if self.routes[name] != sent:
            return True
        if self.config.heads == "always" and sent.output_mode == "head":  # no fallback to text: say why
            self.refused[name] = f"heads=always: the server refused head {sent.head} of {sent.adapter} ({error.message})"
            return False
        route = sent.degrade(error.message)
        if route is None:
            return False
        self.routes[name] = route
        self.mode_switches += 1
        return True

    def _submit(self, query: Query, image) -> Any:
        """Send `image` (BGR, already within max_frame_pixels) with the query's question."""
        while True:
            route = self.route(query)
            if self.route_key(query) in self.refused:
                raise RouteRefused(self.refused[self.route_key(query)])
            try:
                return self.client.submit_image(query.question, [image[:, :, ::-1].copy()], adapter=route.adapter,
                                                output_mode=route.output_mode,
                                                sampling={"max_tokens": self.config.max_new_tokens},
                                                app=self.config.app, tag=query.id or None,
                                                encoding=self.config.encoding,
                                                task=route.head if route.output_mode == "head" else None)
            except ServerError as e:
                if not self._degrade(self.route_key(query), e, route):
                    raise

    def prediction(self, query: Query, final: dict[str, Any], photo_size: tuple[int, int],
                   sent_size: tuple[int, int]) -> Any:
        """The server's final event for `query` as a Prediction whose boxes are pixels of the photo
        (width, height): parsed in the frame sent (sent_size), native boxes by config.grounding."""
        pred = predict(query.kind, final, *sent_size, self.config.box_scale,
                       native_box_size(self.config.grounding, *sent_size), self.route(query).labels)
        pred.boxes = map_boxes(pred.boxes, sent_size, photo_size)
        return pred

    def _result(self, query: Query, image, sent, final: dict | None, error: str | None, started: float,
                route: Route) -> dict[str, Any]:
        """`image`: the photo; `sent`: the frame sent (the photo, or it downscaled). Boxes are
        parsed in the frame sent and mapped back to the photo's pixels."""
        h, w = image.shape[:2]
        sh, sw = sent.shape[:2]
        out: dict[str, Any] = {"id": query.id, "image": query.image, "question": query.question, "kind": query.kind,
                               "route": {"adapter": route.adapter, "output_mode": route.output_mode,
                                         "domain": route.domain, "via": route.via},
                               "answers": query.answers, "box": query.box,
                               "latency_ms": round((time.perf_counter() - started) * 1e3, 2)}
        if query.meta:  # the query line's own keys, carried through
            out["meta"] = query.meta
        if (sw, sh) != (w, h):
            out["sent_size"] = [sw, sh]
        if final is None:
            out["error"] = error
            return out
        pred = self.prediction(query, final, (w, h), (sw, sh))
        out.update(text=final.get("text", ""), prediction=pred.to_dict(), scores=score(query, pred),
                   server_ms=(final.get("timing") or {}).get("total_ms"))
        draw = self.config.draw == "all" or (self.config.draw == "boxes" and (pred.boxes or query.box is not None))
        if draw and self.out_dir is not None:
            out["drawn"] = str(draw_result(image, query, pred, self.out_dir / "drawn"))
        return out

    def ask(self, query: Query) -> dict[str, Any]:
        return self.run(iter([query]))[0]

    def run(self, queries: Iterable[Query]) -> list[dict[str, Any]]:
        """Answer queries, `concurrency` at a time; results in the order of the queries."""
        queries = [self.prepared(q) for q in queries]
        results: list[dict[str, Any] | None] = [None] * len(queries)
        pending: dict[int, tuple[Any, float, Any, Any, Route]] = {}
        nxt = 0
        while nxt < len(queries) or pending:
            while nxt < len(queries) and len(pending) < self.config.concurrency:
                q, started = queries[nxt], time.perf_counter()
                try:
                    image = self.collection.load(q.image)
                    sent = fit_image(image, self.config.max_frame_pixels)
                    stream = self._submit(q, sent)
                    pending[nxt] = (stream, started, image, sent, self.routes[self.route_key(q)])
                except (KeyError, IOError, ServerError, RouteRefused) as e:
                    results[nxt] = {"id": q.id, "image": q.image, "question": q.question, "kind": q.kind,
                                    "error": e.args[0] if isinstance(e, KeyError) else str(e)}
                    if q.meta:
                        results[nxt]["meta"] = q.meta
                    if isinstance(e, (KeyError, BadImage)):  # the query's own input is at fault; nothing was sent
                        results[nxt]["input_error"] = True
                nxt += 1
            for i, (stream, started, image, sent, route) in list(pending.items()):
                final, error = None, None
                try:
                    stream.poll(0.02 if len(pending) > 1 else 0.25)
                    if stream.final is None:
                        if time.perf_counter() - started < self.config.request_timeout_s:
                            continue
                        stream.abort()
                        error = f"no answer within {self.config.request_timeout_s} s"
                    final = stream.final if error is None else None
                except ServerError as e:
                    # e.g. a head the server lacks: generate instead
                    if self._degrade(self.route_key(queries[i]), e, route):
                        try:
                            pending[i] = (self._submit(queries[i], sent), started, image, sent,
                                          self.routes[self.route_key(queries[i])])
                            continue
                        except ServerError as again:
                            e = again
                    error = self.refused.get(self.route_key(queries[i])) or str(e)
                del pending[i]
                results[i] = self._result(queries[i], image, sent, final, error, started, route)
        return results

    def run_batch(self, queries: list[Query], results_path: str | Path | None = None,
                  skipped: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Answer every query, write one JSON line per result, return the report (report.summarise).
        `skipped`: the query file's lines left out ({"line", "error"}, from read_queries), written
        to the results after the answers and listed in the report."""
        results = self.run(queries)
        skipped = list(skipped or [])
        path = Path(results_path) if results_path else (self.out_dir / "results.jsonl" if self.out_dir else None)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = results + [{"skipped_line": s["line"], "error": s["error"]} for s in skipped]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        report = summarise(results, skipped)
        report.update(routes={k: r.to_dict() for k, r in self.routes.items()}, mode_switches=self.mode_switches,
                      results=None if path is None else str(path))
        return report

    def interactive(self, lines: Iterable[str], out: TextIO) -> int:
        """A prompt loop: "<image> <question>" answers, ":images" lists the collection, ":quit" ends."""
        answered = 0
        print(f"{len(self.collection)} images in {self.collection.root}; type '<image> <question>', "
              "':images' or ':quit'", file=out, flush=True)
        for line in lines:
            line = line.strip()
            if not line:
                continue
            if line in (":quit", ":q", ":exit"):
                break
            if line == ":images":
                print("\n".join(self.collection.names), file=out, flush=True)
                continue
            name, _, question = line.partition(" ")
            if not question.strip():
                print("give an image name and a question, e.g. "
                      f"'{self.collection.names[0]} How many cars are there?'", file=out, flush=True)
                continue
            result = self.ask(Query(name, question.strip(), id=str(answered)))
            if "error" in result:
                print(f"error: {result['error']}", file=out, flush=True)
                continue
            answered += 1
            pred = result["prediction"]
            shown = pred["boxes"] if pred["kind"] == "detect" else pred["count"] if pred["kind"] == "count" else \
                pred["label"] if pred["kind"] in ("label", "yes_no") else None
            print(f"[{result['kind']}, {result['route']['adapter'] or 'base model'}, {result['latency_ms']:.0f} ms] "
                  f"{result['text'].strip() or '(no text)'}" + ("" if shown is None else f"  -> {shown}")
                  + (f"  drawn: {result['drawn']}" if result.get("drawn") else ""), file=out, flush=True)
        return answered
