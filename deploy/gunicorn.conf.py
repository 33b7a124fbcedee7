"""gunicorn configuration of the microbatch gateway (the settings `gateway start` uses).

Direct use (every setting is read from the environment, see web_gateway/gunicorn_conf.py):

    MICROBATCH_GATEWAY_MODEL=examples.mlp:MLP REDIS_URL=redis://127.0.0.1:6379/0 \
        gunicorn -c deploy/gunicorn.conf.py --bind 0.0.0.0:8000 --workers 4

The app defaults to ``web_gateway.app:create_app()``; name another factory on the command line
to override it. SIGTERM stops accepting connections and lets in-flight requests finish for up to
``graceful_timeout`` (MICROBATCH_GATEWAY_GRACEFUL_TIMEOUT, default 30 s).
"""

from web_gateway.gunicorn_conf import *  # noqa: F403
