"""Video analytics: camera streams cut into chunks, per-stream accuracy and latency targets."""
