"""The launcher's environment read by ``geomscope.distributed.world_from_env``: torchrun's and
SLURM's variables, each a whole number in its range, or one line naming the variable."""

from __future__ import annotations

import pytest

from geomscope.distributed import world_from_env
from geomscope.errors import InputError

NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def launcher_env(monkeypatch):
    """No launcher variable set (and every one restored after the test, those world_from_env
    writes included); ``set(**values)`` sets some."""
    for k in NAMES:
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)

    def put(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)

    return put


SRUN = dict(MASTER_ADDR="node1", MASTER_PORT="29500")


@pytest.mark.parametrize(
    "values, named",
    [
        (dict(SLURM_NTASKS="two", SLURM_PROCID="0", **SRUN), "SLURM_NTASKS='two'"),
        (dict(SLURM_NTASKS="4", SLURM_PROCID="1.5", **SRUN), "SLURM_PROCID='1.5'"),
        (dict(SLURM_NTASKS="4", SLURM_PROCID="1", SLURM_LOCALID="", **SRUN), "SLURM_LOCALID=''"),
        (dict(SLURM_NTASKS="4", SLURM_PROCID="4", **SRUN), "SLURM_PROCID=4"),
        (dict(SLURM_NTASKS="4", SLURM_PROCID="-1", **SRUN), "SLURM_PROCID=-1"),
        (dict(SLURM_NTASKS="4", SLURM_PROCID="1", SLURM_LOCALID="-2", **SRUN), "SLURM_LOCALID=-2"),
        (dict(WORLD_SIZE="2", RANK="2"), "RANK=2"),
        (dict(WORLD_SIZE="0"), "WORLD_SIZE=0"),
        (dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="-1"), "LOCAL_RANK=-1"),
        (dict(WORLD_SIZE="2", RANK="x"), "RANK='x'"),
    ],
)
def test_a_malformed_launcher_variable_is_one_line_naming_it(launcher_env, values, named):
    """A value that is not a whole number, or lies outside its range (a rank at or past the world
    size, a negative one, an empty world), is refused in one line naming the variable and value:
    never a ValueError, nor a process group that waits for peers that cannot exist."""
    from conftest import one_line_message

    launcher_env(**values)
    with pytest.raises(InputError) as e:
        world_from_env()
    msg = one_line_message(e)
    assert named in msg and "check the launcher" in msg, msg


def test_srun_with_whitespace_around_numbers_still_reads(launcher_env):
    """What int() reads (surrounding blanks) is read as before: the check is of range and form only."""
    launcher_env(SLURM_NTASKS=" 4", SLURM_PROCID="3 ", SLURM_LOCALID="1", **SRUN)
    assert world_from_env() == (3, 4, 1)
