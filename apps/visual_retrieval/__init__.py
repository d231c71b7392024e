"""Visual retrieval: question answering, classification, captions and referring-expression grounding
(boxes) over an image collection, each query routed to the adapter of the manifest domain that asked
its question, else the one the fusion manifest names for its kind (the base model when none), in batch mode over a JSON-lines query file (scored when the
answers are known) or interactively.

    app = RetrievalApp(client, ImageCollection("world/seed0/images"), RetrievalConfig(), manifest, "out")
    report = app.run_batch(read_queries("queries.jsonl"))   # out/results.jsonl, out/drawn/*.png
    app.interactive(sys.stdin, sys.stdout)

Roles: `collection` (images, world truth, truncated or corrupt files refused), `queries` (kinds,
the query file, its malformed lines skipped and its other keys kept as metadata, queries from
truth), `plan` (which domain or task type a query is routed by: a domain that asked its question,
else its kind through `routes`), `fit` (photos downscaled to the server's pixel limit, boxes
mapped back, native box conventions), `scoring` (exact / VQA / IoU /
caption F1), `app` (routing, submission, results), `draw`, `report`. Answer parsing and routing
are shared with apps.video_analytics.
"""

from .app import DEFAULT_ROUTES, RetrievalApp, RetrievalConfig, RouteRefused, route_kind
from .collection import BadImage, ImageCollection
from .fit import GROUNDINGS, fit_image, map_boxes, qwen_resized_size
from .draw import draw_result
from .plan import Plan, matching_domains, plan_query
from .queries import KINDS, Query, classify, read_queries, world_queries, write_queries
from .report import summarise
from .scoring import exact_match, normalise, predict, score, short_answer, token_f1, vqa_normalise, vqa_score

__all__ = [
    "RetrievalApp", "RetrievalConfig", "DEFAULT_ROUTES", "RouteRefused", "route_kind", "Plan", "plan_query",
    "matching_domains", "ImageCollection", "BadImage", "GROUNDINGS", "fit_image",
    "map_boxes", "qwen_resized_size", "Query", "KINDS", "classify",
    "read_queries", "write_queries", "world_queries", "summarise", "draw_result", "predict", "score",
    "short_answer", "exact_match", "vqa_score", "vqa_normalise", "normalise", "token_f1",
]
