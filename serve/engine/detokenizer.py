"""Incremental detokenisation: text deltas per new token without re-decoding whole outputs.

Decodes a short window (`prefix_offset` .. end) and emits what it adds beyond the text of
(`prefix_offset` .. `read_offset`); a delta that ends in an incomplete UTF-8 character (U+FFFD)
is held back until the next token completes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalDetokenizer:
    tokenizer: object
    skip_special_tokens: bool = True
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Appends tokens; returns the newly readable text."""
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character stays as U+FFFD)."""
        full = self._decode(self.token_ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
