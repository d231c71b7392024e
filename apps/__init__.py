"""Applications on top of the server: video analytics and visual retrieval."""
