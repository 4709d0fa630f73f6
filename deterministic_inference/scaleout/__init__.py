"""Scale-out with Ray: N engine replicas behind one OpenAI-compatible endpoint, and sharded workflow runs.

Only `serve --replicas` and `run --ray-address` import the modules that import Ray (`replica`,
`ingress`, `serve_app`, `shards`); `routing` and `metrics_merge` are plain Python. Plain `detinf serve`
never imports this package's Ray parts.
"""
