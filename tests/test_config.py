"""Every environment variable is parsed in `config.Settings.from_env`; bad values fail at once."""

from __future__ import annotations

import dataclasses

import pytest

from dataparallel.config import DEFAULT_BUCKET_BYTES, THREAD_BUCKET_BYTES, Settings

FLAGS = {
    "DATAPARALLEL_CHECK": "check",
    "DATAPARALLEL_DEBUG": "debug",
    "DATAPARALLEL_CUDA_AWARE_MPI": "cuda_aware_mpi",
    "DATAPARALLEL_OVERLAP": "overlap",
    "DATAPARALLEL_HIERARCHICAL": "hierarchical",
    "DATAPARALLEL_MPI_SLEEP": "mpi_sleep",
}


def test_defaults_from_an_empty_environment() -> None:
    settings = Settings.from_env({})
    assert settings == Settings()
    assert settings.check is True and settings.debug is False
    assert settings.timeline is None and settings.cuda_aware_mpi is None
    assert settings.bucket_bytes == DEFAULT_BUCKET_BYTES == 256 * 1024
    assert settings.thread_bucket_bytes == THREAD_BUCKET_BYTES == 25 << 20
    assert settings.timeout is None and settings.overlap is None  # None: chosen per machine
    assert not settings.mpi_launched and not settings.torchrun_launched
    assert settings.mpi_rank is None


def test_the_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAPARALLEL_BUCKET_BYTES", "12345")
    assert Settings.from_env().bucket_bytes == 12345


@pytest.mark.parametrize("variable", list(FLAGS))
@pytest.mark.parametrize(
    ("raw", "value"),
    [
        *[("1", True), ("true", True), (" YES ", True), ("on", True)],
        *[("0", False), ("False", False), ("no", False), ("off", False)],
    ],
)
def test_flags(variable: str, raw: str, value: bool) -> None:
    assert getattr(Settings.from_env({variable: raw}), FLAGS[variable]) is value


@pytest.mark.parametrize("variable", list(FLAGS))
def test_an_empty_flag_means_the_default(variable: str) -> None:
    default = getattr(Settings(), FLAGS[variable])
    assert getattr(Settings.from_env({variable: ""}), FLAGS[variable]) is default


@pytest.mark.parametrize("variable", list(FLAGS))
def test_invalid_flags_list_the_valid_values(variable: str) -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_env({variable: "maybe"})
    message = str(info.value)
    assert message.startswith(f"{variable}='maybe' is not a valid flag: use one of")
    for valid in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert repr(valid) in message


def test_timeline_path() -> None:
    assert Settings.from_env({"DATAPARALLEL_TIMELINE": "/tmp/t.json"}).timeline == "/tmp/t.json"
    assert Settings.from_env({"DATAPARALLEL_TIMELINE": ""}).timeline is None


def test_bucket_bytes_and_timeout() -> None:
    settings = Settings.from_env(
        {"DATAPARALLEL_BUCKET_BYTES": "1048576", "DATAPARALLEL_TIMEOUT": "2.5"}
    )
    assert settings.bucket_bytes == 1048576 and isinstance(settings.bucket_bytes, int)
    assert settings.thread_bucket_bytes == 1048576  # the variable sets both
    assert settings.timeout == 2.5


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),  # torch's own default
        ({"DATAPARALLEL_TIMEOUT": "2.5"}, 2.5),
        ({"DATAPARALLEL_ELASTIC_WORKER": "w1"}, 600.0),
        ({"DATAPARALLEL_ELASTIC_WORKER": "w1", "DATAPARALLEL_ELASTIC_TIMEOUT": "40"}, 40.0),
        ({"DATAPARALLEL_ELASTIC_WORKER": "w1", "DATAPARALLEL_TIMEOUT": "2.5"}, 2.5),
        ({"DATAPARALLEL_ELASTIC_TIMEOUT": "40"}, None),  # not a worker
    ],
)
def test_group_timeout_is_the_timeout_else_an_elastic_workers(
    env: dict[str, str], expected: float | None
) -> None:
    assert Settings.from_env(env).group_timeout == expected


@pytest.mark.parametrize("raw", ["abc", "1.5", "0", "-4", "1e3"])
def test_invalid_bucket_bytes(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^DATAPARALLEL_BUCKET_BYTES='{raw}' .*positive integer"):
        Settings.from_env({"DATAPARALLEL_BUCKET_BYTES": raw})


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "nan"])
def test_invalid_timeout(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"^DATAPARALLEL_TIMEOUT='{raw}' .*positive number"):
        Settings.from_env({"DATAPARALLEL_TIMEOUT": raw})


def test_torchrun_variables() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    settings = Settings.from_env(env)
    assert (settings.rank, settings.world_size) == (3, 4)
    assert (settings.local_rank, settings.local_world_size) == (1, 2)
    assert (settings.master_addr, settings.master_port) == ("10.0.0.1", 29500)
    assert settings.torchrun_launched
    partial = {k: v for k, v in env.items() if k != "MASTER_ADDR"}
    assert not Settings.from_env(partial).torchrun_launched


@pytest.mark.parametrize("variable", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"])
def test_invalid_integers(variable: str) -> None:
    with pytest.raises(ValueError, match=rf"^{variable}='x1' is not an integer"):
        Settings.from_env({variable: "x1"})


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({"PMI_RANK": "2", "PMI_SIZE": "3"}, 2),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, 1),
        ({"PMIX_RANK": "0"}, 0),
        ({"HYDI_CONTROL_FD": "7"}, None),
    ],
)
def test_mpi_launchers_are_recognized(env: dict[str, str], rank: int | None) -> None:
    settings = Settings.from_env(env)
    assert settings.mpi_launched and settings.mpi_rank == rank


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().check = False  # type: ignore[misc]
