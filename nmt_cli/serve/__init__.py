"""`nmt serve`, the HTTP service: app.py (the routes, the server's life, its signals),
requests.py (what a request may ask), batcher.py (the decoding queue and its thread),
connections.py (what a connection may hold and for how long)."""
