"""Worker processes: `specroute serve --workers N`.

A supervisor (supervisor.py) reserves the port, keeps the figures the workers share (figures.py)
and serves them on a Unix socket (store.py); each worker (worker.py) is a whole router accepting
on the port with `SO_REUSEPORT`, sharing through that socket as replicas share through Redis
(router.replicas), and reaching the other workers for one scrape, one status, one admin call
(peers.py, exposition.py). See docs/workers.md.
"""
