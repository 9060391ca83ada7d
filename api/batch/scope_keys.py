"""The ASGI scope keys of a request the app makes to itself (a batch line, api/batch/line_call.py).
Only in-process code builds a scope, so no client can set them: no header, path or body reaches
a scope key. Kept apart (a leaf module) so that `auth` and the generation routes read them without
importing the batch service."""

from __future__ import annotations

CALLER = "loraplex.caller"  # the `Caller` the request runs as (auth.require_user takes it)
BATCH_LINE = "loraplex.batch_line"  # True: a batch line, run at the lowest scheduling priority
