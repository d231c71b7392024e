"""Visual retrieval: question answering, captions and grounding over image collections."""
