"""What the command line says when something is wrong: one line, the flag or command that fixes it, and
exit status 2 for a usage error. In-process and without a server, so it is cheap."""

from __future__ import annotations

import sys

import pytest

from infemeral.cli.main import main


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("argv, says", [
    (("--temperature", "-1"), "--temperature must be greater than or equal to 0 (got -1)"),
    (("--seed", "99999999999999999999999"), "--seed must be less than or equal to 18446744073709551615"),
    (("--top-p", "0"), "--top-p must be greater than 0 (got 0)"),
    (("--timeout", "soon"), "--timeout must be a valid number"),
])
def test_a_bad_flag_is_one_line_naming_it(capsys, argv, says):
    code, text = run(capsys, "generate", "hi", *argv)
    assert code == 2
    assert text.startswith(f"infemeral-client: {says}") and text.count("\n") == 1, text
    assert "pydantic" not in text and "http" not in text


def test_a_bad_environment_variable_is_named_as_such(capsys, monkeypatch):
    monkeypatch.setenv("INFEMERAL_TOP_K", "-3")
    code, text = run(capsys, "generate", "hi")
    assert code == 2 and text == "infemeral-client: INFEMERAL_TOP_K must be greater than or equal to 0 (got -3)\n"


def test_plaintext_off_loopback_is_refused_naming_the_flags(capsys, tmp_path):
    from infemeral.server.main import main as server_main

    code = server_main(["--bundle", str(tmp_path), "--listen", "0.0.0.0:0", "--store", str(tmp_path / "store")])
    text = capsys.readouterr().err
    assert code == 2 and "refusing plaintext gRPC on 0.0.0.0:0" in text
    assert "--tls-cert" in text and "--listen 127.0.0.1:0" in text and "--allow-plaintext" in text
    assert text.count("\n") == 1, text


def test_an_empty_prompt_is_refused(capsys, monkeypatch):
    import io

    expected = "infemeral-client: the prompt is empty: give the question as an argument, or '-' to read it from stdin\n"
    assert run(capsys, "generate", "") == (2, expected)
    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))
    assert run(capsys, "generate", "-") == (2, expected)


def test_greedy_and_a_temperature_contradict(capsys):
    assert run(capsys, "generate", "hi", "--greedy", "--temperature", "0.5") == (
        2, "infemeral-client: --greedy is --temperature 0: give one of them\n")


@pytest.mark.parametrize("command, says", [("info", "check that the client bundle belongs to it"),
                                           ("delete", "its encrypted KV cache on the server")])
def test_every_command_says_what_it_does_in_its_help(capsys, command, says):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert says in " ".join(capsys.readouterr().out.split())


def test_ctrl_c_leaves_the_shell_prompt_on_a_line_of_its_own(capsys, monkeypatch):
    from infemeral.cli import main as cli_main

    def interrupted(args):
        print("Paris is the capital", end="", flush=True)  # an answer cut off mid-line
        raise KeyboardInterrupt

    monkeypatch.setitem(cli_main.COMMANDS, "generate", interrupted)
    code = main(["generate", "hi"])
    out = capsys.readouterr()
    assert code == 130 and out.out == "Paris is the capital" and out.err == "\n"


def test_a_bad_server_flag_is_one_line_too(capsys, tmp_path):
    from infemeral.server.main import main as server_main

    assert server_main(["--bundle", str(tmp_path), "--max-context", "0"]) == 2
    assert capsys.readouterr().err == ("infemeral-server: --max-context must be greater than or equal to 1 (got 0)\n")


def test_an_api_key_file_that_is_not_there_is_one_line(capsys, tmp_path):
    code, text = run(capsys, "generate", "hi", "--api-key-file", tmp_path / "key")
    assert code == 2 and text == f"infemeral-client: --api-key-file {tmp_path / 'key'}: No such file or directory\n"
    (tmp_path / "key").write_text("# the pod's key\n\n")
    code, text = run(capsys, "generate", "hi", "--api-key-file", tmp_path / "key")
    assert code == 2 and text == f"infemeral-client: --api-key-file {tmp_path / 'key'} holds no API key\n"


def test_preparing_the_default_model_without_gguf_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now fails as if it were not installed
    code, text = run(capsys, "prepare", "--quiet", "--output", tmp_path)
    assert code == 2
    assert text == ("infemeral-client: reading a .gguf file (the default model is one) needs the gguf package: "
                    "pip install 'infemeral[gguf]'\n")


def test_the_server_log_level_is_a_setting_with_its_variable(capsys, monkeypatch, tmp_path):
    from infemeral.server.main import main as server_main
    from infemeral.server.settings import ServerSettings

    monkeypatch.setenv("INFEMERAL_LOG_LEVEL", "WARNING")
    assert ServerSettings().log_level == "WARNING"
    monkeypatch.setenv("INFEMERAL_LOG_LEVEL", "LOUD")
    assert server_main(["--bundle", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("infemeral-server: INFEMERAL_LOG_LEVEL must be 'DEBUG', 'INFO', ")


@pytest.mark.parametrize("finish, round_trips", [("eos", 11), ("length", 10), ("stop", 10)])
def test_without_speculation_verbose_says_one_token_per_round_trip(capsys, finish, round_trips):
    from infemeral.cli.commands import _report
    from infemeral.client.result import TurnResult

    # 10 tokens without drafts: a round trip each (the prompt's brings the first), and one more for an
    # end-of-sequence token, which the answer leaves out
    result = TurnResult(prompt_tokens=5, generated_tokens=10, round_trips=round_trips, finish_reason=finish)
    _report(result, verbose=True)
    assert "1.00 tokens per round trip" in capsys.readouterr().err
