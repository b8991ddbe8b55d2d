"""``infinikv serve``: an OpenAI-compatible HTTP server where each request chooses its KV policy.

``app`` holds ``create_app`` and the routes, ``schemas`` the request bodies, ``sampling`` a request's
prompt tokens and ``GenerationConfig``, ``kv_policy`` its KV policy and the ``kv`` field, ``openai_shapes``
the answers, chunks and errors in OpenAI's shapes, ``answers`` a job's events into the HTTP answer,
``scheduler`` the request queue and the worker thread that steps the engine (or, ``--scheduler static``,
batches requests into ``Generator.generate`` calls), ``metrics`` the Prometheus metrics, ``loadgen`` the
``infinikv bench-serve`` load generator, and ``cli`` both subcommands. Import
``infinikv.serve.app.create_app`` to serve an already-loaded model.
"""

# --request-timeout's default: seconds from a request's arrival until it is cancelled and answered 504, past
# any one request this server runs (here, where the command line reads it without loading the app)
DEFAULT_REQUEST_TIMEOUT = 600.0
