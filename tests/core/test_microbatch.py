"""The micro-batch count: more than the stages only when links leave bubbles."""

from engine.core.microbatch import choose, predict_throughput


def flat(seconds, per_seq=0.0):
    return lambda b: seconds + per_seq * b


def test_fast_links_keep_one_micro_batch_per_stage():
    stages = [flat(0.02, 0.001)] * 3
    busy = [flat(0.0, 0.00001)] * 2
    assert choose(3, 24, stages, busy, [0.0001] * 3) == 3


def test_slow_links_add_micro_batches_up_to_twice_the_stages():
    stages = [flat(0.002, 0.002)] * 2      # compute grows with the batch
    busy = [flat(0.0, 0.004)]              # a slow uplink: 4 ms per sequence's activations
    latency = [0.030, 0.030]
    k = choose(2, 32, stages, busy, latency)
    assert 2 < k <= 4
    assert predict_throughput(k, 32, stages, busy, latency) > predict_throughput(2, 32, stages, busy, latency)


def test_bounds_on_the_count():
    stages = [flat(0.0, 0.01)] * 2
    busy = [flat(0.0, 0.01)]
    latency = [1.0, 1.0]
    assert choose(2, 100, stages, busy, latency) == 4      # never past 2M
    heavy = [flat(0.0, 0.5)] * 2
    assert choose(2, 3, heavy, [flat(0.0, 0.5)], latency) == 3   # never past the sequences
    assert choose(2, 1, stages, busy, latency) == 2


def test_throughput_model_counts_the_bottleneck_not_latency():
    stages = [flat(0.1), flat(0.1)]
    busy = [flat(0.0)]
    # two micro-batches of 4 keep both stages busy: 8 tokens every 0.2 s
    assert abs(predict_throughput(2, 8, stages, busy) - 40.0) < 1e-6
    # latency stretches the loop; it is not a resource the micro-batches queue on
    assert abs(predict_throughput(2, 8, stages, busy, [0.3, 0.3]) - 8 / 0.8) < 1e-6
