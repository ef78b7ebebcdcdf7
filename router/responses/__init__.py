"""The Responses API's affinity: which backend holds a stored response."""
