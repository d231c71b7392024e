"""What the engine thread does when a step raises: charge the failure to the request that causes it.

`StepFailures` is a part of `EngineLoop` (serve/rpc/loop.py), kept apart by role: the loop moves
requests in and outputs out; this decides who a failed step's fault belongs to, who starts over, and
which kinds of request are refused from then on (serve/rpc/culprits.py).

Why the others restart rather than keep their progress: after a failed model step the engine's state
is not known to be clean (seeded generators advanced mid-sample, a head's rows kept, pixels released
after encoding), and a restart from the prompt is always right. What bounds the cost is that a
culprit's kind is remembered: a request of that kind is refused at the door (`EngineLoop.refuses`) or,
if already queued, when the loop takes it, so each kind of failing request restarts the others at
most once.
"""

from __future__ import annotations

import logging

from .culprits import NEUTRAL_PROMPT, neutral_probe
from .logs import clip

log = logging.getLogger("vlora.serve.rpc")
MAX_ALONE_STEPS = 8  # a suspect runs alone until its first token (a chunked prompt takes a few steps)
MAX_RESTARTS = 3  # failures no single request could be charged with that one request lives through


class StepFailures:
    """Mixed into EngineLoop; uses its engine, lock, tickets, requests, counters and culprits."""

    def _log_failure(self, e: Exception, outcome: str) -> None:
        """One clipped line per failed step; the traceback only the first time a place fails."""
        frame = e.__traceback__
        while frame is not None and frame.tb_next is not None:
            frame = frame.tb_next
        site = (type(e).__name__, frame.tb_frame.f_code.co_filename if frame else "", frame.tb_lineno if frame else 0)
        first = site not in self._failure_sites and len(self._failure_sites) < 256
        self._failure_sites.add(site)
        log.error("engine step failed (%s: %s); %s", type(e).__name__, clip(str(e), 160), outcome,
                  exc_info=e if first else None)

    def _isolate(self) -> tuple[int, int]:
        """Every request in flight is taken out; the suspects (those of the failed step's batch, or all
        when it failed before its batch was known) run alone until their first token; one that fails
        alone is answered engine_error and remembered (`_charge`); the others start over (a
        "restart" event, then their tokens from the beginning), all at once after the trial. A
        request of a kind found in this same trial is charged without a run. If no one fails alone
        (a fault of a mix of requests), all restart, and one that has lived through MAX_RESTARTS such
        failures is answered engine_error: no fault loops forever. Returns (charged, restarted)."""
        batch = getattr(self.engine, "last_batch", None)  # a long queue outside the batch is not tried
        remaining, self._tickets = self._tickets, {}
        requests, self._requests = self._requests, {}
        suspects = [rid for rid in remaining if not batch or rid in batch]
        verdicts: dict[str, str | None] = dict.fromkeys(remaining)
        try:
            with self.lock:
                for rid in remaining:
                    self.engine.abort(rid)
                self.engine.step()  # the aborts' outputs: nobody is waiting for them
            for rid in suspects:
                request = requests[rid]
                known = self.culprits.refuses(request)
                verdicts[rid] = known if known is not None else self._alone(request)
                if known is None and verdicts[rid] is not None:
                    self._charge(request, verdicts[rid])
        except Exception:  # the engine fails even in a trial: everyone goes back for _fail_all
            self._tickets.update(remaining)
            raise
        for rid in remaining:  # queued behind the batch, of a kind found now: it would only fail again
            if verdicts[rid] is None:
                verdicts[rid] = self.culprits.refuses(requests[rid])
        charged = sum(v is not None for v in verdicts.values())
        restarted = 0
        for rid, ticket in remaining.items():
            failure = verdicts[rid]
            if failure is None and not charged:
                self._restarts[rid] += 1
                if self._restarts[rid] >= MAX_RESTARTS:
                    failure = f"{MAX_RESTARTS} failed steps while it ran, none charged to a single request"
            if failure is not None:
                self._restarts.pop(rid, None)
                self.counters["step_errors_attributed"] += 1
                ticket.put({"type": "error", "error": {"type": "engine_error", "message":
                            f"the engine cannot run this request ({clip(failure)})"}})
            else:
                restarted += 1
                self.counters["restarts"] += 1
                ticket.put({"type": "restart"})
                self._add_again(requests[rid], ticket)
        return charged, restarted

    def _alone(self, request) -> str | None:
        """Runs `request` alone until its first token (or MAX_ALONE_STEPS); None if it ran, else why not.
        The engine holds nothing else meanwhile; the request is taken out again either way."""
        rid = request.request_id
        try:
            with self.lock:
                self.engine.add_request(request)
        except Exception:  # admission refuses it now (its adapter unloaded, ...): _add_again says so
            return None
        failure = None
        try:
            with self.lock:
                for _ in range(MAX_ALONE_STEPS):
                    if any(o.request_id == rid and (o.finished or o.new_token_ids) for o in self.engine.step()):
                        break
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
        with self.lock:  # an engine that cannot even abort and flush fails here, for _fail_all
            self.engine.abort(rid)
            self.engine.step()
        return failure

    def _charge(self, request, failure: str) -> None:
        """Remembers a request that failed alone: by its kind if a neutral probe of it (the same fields,
        a plain prompt, black frames of the same sizes) fails too, else by its exact content. Nothing
        is remembered when even a plain base-model request fails now: then the engine itself is
        failing, and refusing this kind would refuse requests that are not at fault."""
        by_kind = self._alone(neutral_probe(request, f"{request.request_id}#probe")) is not None
        if by_kind:
            canary = type(request)(prompt=NEUTRAL_PROMPT, sampling=type(request.sampling)(max_tokens=1),
                                   request_id=f"{request.request_id}#canary")
            if self._alone(canary) is not None:
                return
        self.culprits.record(request, by_kind, failure.split(":", 1)[0])  # the exception's name only
        self.counters["failing_kinds" if by_kind else "failing_contents"] += 1

    def _add_again(self, request, ticket) -> None:
        try:
            with self.lock:
                self.engine.add_request(request)
        except Exception as e:
            ticket.put({"type": "error", "error": {"type": "rejected", "message": clip(str(e))}})
            return
        self._tickets[ticket.request_id] = ticket
        self._requests[ticket.request_id] = request

    def _fail_all(self, message: str) -> None:
        tickets, self._tickets = self._tickets, {}
        self._requests.clear()
        self._restarts.clear()
        for request_id, ticket in tickets.items():
            try:
                with self.lock:
                    self.engine.abort(request_id)
            except Exception:  # the engine's state for it is gone already
                log.exception("abort of %s after a failed step", request_id)
            ticket.put({"type": "error", "error": {"type": "engine_error", "message": message}})
        try:
            with self.lock:
                self.engine.step()  # flush the aborts' outputs so nothing lingers in the engine
        except Exception:
            log.exception("flushing aborted requests failed")
