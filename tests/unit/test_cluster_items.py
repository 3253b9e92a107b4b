"""What a cluster replica sends the front crosses Ray pickled: every kind must come back whole."""

import pickle

from dflash.cluster.replica import JobRequest, Queued, Refused, Started
from dflash.engine.contract import GenerationStats
from dflash.sampling_params import SamplingParams
from dflash.scheduler import EngineFailed, JobRecord, JobStep


def test_stream_items_survive_pickling():
    items = [JobRequest((1, 2, 3), SamplingParams(), 8, "r1", (2,), None, None, "session"), Queued("replica"),
             Started(1.5), JobStep([7], None, GenerationStats(prompt_tokens=3)), Refused(),
             JobRecord("r1", "finished", "decode", None, 0.1, GenerationStats(prompt_tokens=3))]
    assert [pickle.loads(pickle.dumps(item)) for item in items] == items
    failure = pickle.loads(pickle.dumps(EngineFailed("generation failed: boom")))
    assert isinstance(failure, EngineFailed) and str(failure) == "generation failed: boom"
