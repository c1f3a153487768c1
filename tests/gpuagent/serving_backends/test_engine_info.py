"""How evidence names the server it came from: the engine's own answers where it
gives them, the command's program where it doesn't."""

from gpuagent.serving.engine_info import describe_server, program_name


def test_the_program_is_the_module_a_python_command_runs():
    assert program_name(["/usr/bin/python3", "-m", "gpuagent.engine", "serve"]) == (
        "gpuagent.engine"
    )
    assert program_name(["/opt/venv/bin/vllm", "serve", "/m"]) == "vllm"
    assert program_name(["python3.11", "/srv/server.py", "--port", "1"]) == "server.py"
    assert program_name(["python3", "-u"]) == "python3"
    assert program_name([]) == ""


def test_a_server_that_says_nothing_is_named_by_its_program():
    engine = describe_server(
        "http://127.0.0.1:9/v1", "external", ["sglang", "serve"], timeout_s=1
    )

    assert (engine.name, engine.version) == ("sglang", "")
    assert engine.command == ["sglang", "serve"]
