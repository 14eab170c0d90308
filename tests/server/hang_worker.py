"""A Worker that hangs (as a stuck kernel or collective would) in a step that holds token 99,
for the hung-engine-core test. Loaded in the engine-core process by ``worker_cls``."""
from __future__ import annotations

import time

from tandem.worker.worker import Worker

HANG_TOKEN = 99


class HangWorker(Worker):
    def execute_model(self, so):
        if any(r.new is not None and HANG_TOKEN in r.new.token_ids for r in so.requests):
            time.sleep(3600)
        return super().execute_model(so)
