"""The OpenAI Batch API, run on the cluster's spare throughput: files and batches kept in a
store (store.py), input files checked (files.py), the endpoints (api.py), the lines run through
the router's own request path (runner.py)."""
