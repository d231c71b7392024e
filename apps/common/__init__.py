"""What both applications use: answers (head output or parsed text -> Prediction), routing (the
fusion manifest -> adapter, head and output mode), drawing boxes and banners, latency percentiles.
Like the applications themselves, it reaches the server only through serve.rpc's client."""
