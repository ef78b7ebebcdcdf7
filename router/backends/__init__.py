"""The engines behind the router: slots and queues, health, ejection, what they report."""
