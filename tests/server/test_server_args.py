"""ServerArgs: CLI defaults come from the dataclass, flags map onto fields, bad combinations fail clearly."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from common.server.server_args import ServerArgs, add_cli_args, from_cli_args, parse_server_args


def test_cli_defaults_equal_the_dataclass_defaults() -> None:
    assert parse_server_args([]) == ServerArgs()
    parser = add_cli_args(argparse.ArgumentParser())
    assert {a.dest for a in parser._actions} >= {f.name for f in dataclasses.fields(ServerArgs)}


def test_flags_map_onto_fields() -> None:
    args = parse_server_args(
        [
            "--model-path", "/m", "--port", "31000", "--page-size", "32", "--chunked-prefill-size", "64",
            "--max-total-tokens", "2048", "--schedule-policy", "fcfs", "--disable-radix-cache",
            "--enable-mixed-chunk", "--request-timeout", "2.5", "--disaggregation-fault-spec", "drop:3",
        ]
    )  # fmt: skip
    assert (args.model_path, args.port, args.page_size, args.chunked_prefill_size) == ("/m", 31000, 32, 64)
    assert (args.max_total_tokens, args.request_timeout) == (2048, 2.5)
    assert args.disable_radix_cache and args.enable_mixed_chunk and not args.disable_overlap_schedule
    assert args.disaggregation_fault_spec == "drop:3"
    assert parse_server_args(["--device", "cpu"]).overlap_schedule is True  # 1.03x the normal loop there
    assert parse_server_args(["--device", "cpu", "--disable-overlap-schedule"]).overlap_schedule is False
    assert parse_server_args(["--device", "cpu", "--enable-cpu-overlap-schedule"]).overlap_schedule is True
    assert parse_server_args(["--device", "cuda"]).overlap_schedule is True
    both = ["--device", "cuda", "--enable-cpu-overlap-schedule", "--disable-overlap-schedule"]
    assert parse_server_args(both).overlap_schedule is False
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(["--random-seed", "7"])
    assert from_cli_args(ns).random_seed == 7


def test_role_defaults_and_derived_values() -> None:
    args = parse_server_args([], disaggregation_mode="prefill")
    assert args.is_prefill and not args.is_decode
    assert (
        parse_server_args(["--disaggregation-mode", "null"], disaggregation_mode="decode").disaggregation_mode
        == "null"
    )
    assert ServerArgs(disable_radix_cache=True).effective_schedule_policy == "fcfs"
    assert ServerArgs().effective_schedule_policy == "lpm"
    assert ServerArgs(device="cpu").resolved_device() == "cpu"
    assert ServerArgs(host="0.0.0.0", port=1234).url() == "http://0.0.0.0:1234"


def test_resolved_fills_tokenizer_and_name_from_a_checkpoint_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = ServerArgs(model_path=str(tmp_path)).resolved()
    assert args.tokenizer_path == args.served_model_name == str(tmp_path)
    named = ServerArgs(model_path=str(tmp_path), served_model_name="m", tokenizer_path="/t").resolved()
    assert (named.served_model_name, named.tokenizer_path) == ("m", "/t")
    with pytest.raises(Exception, match="not a checkpoint directory"):
        ServerArgs(model_path=str(tmp_path / "missing")).resolved()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_policy": "sjf"}, "--schedule-policy must be one of"),
        ({"page_size": 0}, "--page-size must be > 0"),
        ({"chunked_prefill_size": 100}, "multiple of --page-size 16"),
        ({"max_total_tokens": 8}, "smaller than one page"),
        ({"attention_backend": "flashinfer", "device": "cpu"}, "flashinfer needs CUDA"),
        ({"enable_mixed_chunk": True, "disaggregation_mode": "decode"}, "needs --disaggregation-mode null"),
        (
            {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 30000},
            "must differ from --port",
        ),
        ({"port": 70000}, "TCP port"),
        ({"request_timeout": 0.0}, "--request-timeout must be > 0"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
        ({"disaggregation_heartbeat_timeout": 1.0}, "heartbeat-timeout must be >"),
        ({"num_reserved_decode_tokens": -1}, "--num-reserved-decode-tokens"),
    ],
)
def test_invalid_combinations_fail_with_the_flag_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="invalid server arguments") as err:
        ServerArgs(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_cli_rejects_unknown_choices() -> None:
    with pytest.raises(SystemExit):
        parse_server_args(["--disaggregation-mode", "both"])


def test_tp_size_flag_and_its_alias() -> None:
    assert parse_server_args([]).tp_size == 1
    assert parse_server_args(["--tp-size", "2"]).tp_size == 2
    assert parse_server_args(["--tensor-parallel-size", "4"]).tp_size == 4
    with pytest.raises(ValueError, match="--tp-size must be > 0"):
        ServerArgs(tp_size=0)
