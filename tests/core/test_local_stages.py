"""engine/core/local_stages.py: a host alone runs one process, on a GPU and on a CPU,
unless the user says how many."""

import pytest

from engine.core.errors import ModelError
from engine.core.local_stages import default_local_stages, local_stages


def test_one_process_on_a_gpu_and_on_a_cpu():
    assert default_local_stages("cuda:0") == 1 and default_local_stages("cuda:3") == 1
    assert default_local_stages("cpu") == 1


def test_a_count_the_user_gives_is_kept():
    assert local_stages(3, "cuda:0") == 3 and local_stages(2, "cpu") == 2
    assert local_stages(None, "cuda:0") == 1 and local_stages(0, "cpu") == 1


@pytest.mark.parametrize("bad", [-1, 9, 2.5, True, False, "2"])
def test_a_count_out_of_range_is_refused_with_the_range(bad):
    with pytest.raises(ModelError, match="from 1 to 8"):
        local_stages(bad, "cpu")
