"""The request path, one stage a module: ingress, decide, forward, relay, observe."""
