"""`nmt serve`, the HTTP service: app.py (the routes, the server's life, its signals),
requests.py (what a request may ask), connections.py (what a connection may hold and for how
long), and the decoding queue in three rooms by state: queue.py (the requests waiting, their
work and memory, and the pure decisions of who goes first and what may begin), lanes.py (nmt's
running batches, which sentences join between steps), batcher.py (the loop that begins batches
and decodes them in threads); turns.py (the steps that take turns), contract.py (what the
server needs of a translator, typed).

The wing may import the ground, the configs, the engine's hypotheses and inference/; only the
commands (cli/) import it.
"""
