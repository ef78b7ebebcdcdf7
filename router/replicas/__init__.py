"""What router replicas share: each client's requests in flight and remembered peak, and each
backend's slots in use and requests sent since its last reading.

    store.py   the interface a sharing mechanism implements (`Store`), and its records
    redis.py   `RedisStore`: one Redis that every replica reaches (`state.redis_url`)
    lua.py     the scripts it runs, each atomic on the server
    coalesce.py  calls asked for while one is under way, sent together in the next
    lease.py   `Leases`: slots claimed ahead of the requests, which take them without a call
    shared.py  `Replicas`: what the router asks, under a strict time budget; alone, or with a
               store that is slow or down, the replica decides from its own view
"""
