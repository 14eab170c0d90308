"""A Worker that hangs (as a stuck kernel or collective would) in a step that holds token 99,
and takes a few seconds (as a long step on a slow machine would) over one that holds token
98, for the hung- and slow-engine-core tests. Loaded in the engine-core process by
``worker_cls``."""
from __future__ import annotations

import time

from tandem.worker.worker import Worker

HANG_TOKEN, SLOW_TOKEN = 99, 98
SLOW_STEP_S = 4.0


class HangWorker(Worker):
    def execute_model(self, so):
        new_tokens = [t for r in so.requests if r.new is not None for t in r.new.token_ids]
        if HANG_TOKEN in new_tokens:
            time.sleep(3600)
        if SLOW_TOKEN in new_tokens:
            time.sleep(SLOW_STEP_S)
        return super().execute_model(so)
