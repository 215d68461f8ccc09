"""Harbor task suites (``posttrain.experimental.harbor``): the spec, task checks, and the bubblewrap backend's
tools, verifier and containment, with the real sandbox (bubblewrap) and the example suite in ``examples/``.

The containment tests play the agent: they run through ``HarborBashEnv.bash`` what a policy could send, and check
that it cannot read the host's files, reach a listener on 127.0.0.1, or forge the verifier's reward.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import sys

import pytest
from harbor_helpers import EXAMPLE_TASKS, HARNESSES, TASK_NAMES, make_task, needs_bwrap, solution

from posttrain.agents.environments import EnvironmentPool, environment_tool_names
from posttrain.experimental.harbor import (
    HarborBashEnv,
    HarborEnv,
    HarborSpec,
    HarborTaskError,
    HarborVerifierError,
    SandboxLimits,
)
from posttrain.experimental.harbor._local import plan_workspace
from posttrain.experimental.harbor._spec import _outcome_reward_func, resolve_agent
from posttrain.experimental.harbor._task import load_task

BW = "bubblewrap"


def _bash_env(task_dir, **limits) -> HarborBashEnv:
    env = HarborBashEnv(environment_type=BW, sandbox_limits=SandboxLimits(**limits) if limits else None)
    env.reset(task_dir=str(task_dir))
    return env


# --- the spec and the task format (no sandbox needed) ---------------------------------------------------------------


def test_spec_builds_the_dataset_with_num_tasks_and_indices():
    spec = HarborSpec(EXAMPLE_TASKS)
    data = spec.train_dataset
    assert data["task_name"] == TASK_NAMES and data["task_index"] == [0, 1, 2, 3, 4]
    assert data["prompt"] == [[{"role": "user", "content": ""}]] * 5  # reset appends the instruction
    assert data["task_dir"][1] == str(EXAMPLE_TASKS / "fix-mean")
    assert data.column_names == [
        "prompt", "task_dir", "task_name", "task_index", "gold_answer", "reward_mode", "difficulty_level",
        "kaggle_dataset",
    ]  # fmt: skip
    assert data["gold_answer"][0] == "4"  # [metadata] gold_answer of count-errors
    assert HarborSpec(EXAMPLE_TASKS, num_tasks=2).train_dataset["task_name"] == ["count-errors", "fix-mean"]
    picked = HarborSpec(EXAMPLE_TASKS, indices=[4, 1]).train_dataset
    assert picked["task_name"] == ["write-config", "fix-mean"] and picked["task_index"] == [4, 1]
    assert HarborSpec(EXAMPLE_TASKS, num_tasks=99).train_dataset.num_rows == 5
    assert "gold_answer" not in HarborSpec(EXAMPLE_TASKS, include_metadata=False).train_dataset.column_names
    # TRL's layout: a suite directory with a tasks/ subtree; a single task directory is a suite of one.
    assert HarborSpec(EXAMPLE_TASKS / "hello-file").train_dataset["task_name"] == ["hello-file"]
    with pytest.raises(ValueError, match="num_tasks or indices, not both"):
        HarborSpec(EXAMPLE_TASKS, num_tasks=1, indices=[0])
    with pytest.raises(ValueError, match="num_tasks must be a positive integer"):
        HarborSpec(EXAMPLE_TASKS, num_tasks=0)
    with pytest.raises(ValueError, match="indices must be a non-empty list"):
        HarborSpec(EXAMPLE_TASKS, indices=[])
    with pytest.raises(ValueError, match=r"indices \[7\] are out of range: .* has 5 tasks"):
        _ = HarborSpec(EXAMPLE_TASKS, indices=[0, 7]).train_dataset
    with pytest.raises(ValueError, match="sandbox_limits applies to environment_type='bubblewrap' only"):
        HarborSpec(EXAMPLE_TASKS, sandbox_limits=SandboxLimits())


def test_agents_resolve_from_names_import_paths_files_and_classes():
    assert resolve_agent("bash") is HarborBashEnv
    assert resolve_agent("posttrain.experimental.harbor:HarborBashEnv") is HarborBashEnv
    jupyter = resolve_agent(f"{HARNESSES}:JupyterEnv")
    assert issubclass(jupyter, HarborEnv) and jupyter.__name__ == "JupyterEnv"
    # The tools GRPO sees: public methods only (reset, the reward and task properties, _exec and _setup are not).
    assert environment_tool_names(HarborBashEnv) == ["bash"]
    assert environment_tool_names(jupyter) == ["add_and_execute_code_cell", "execute_shell_command"]
    assert environment_tool_names(resolve_agent(f"{HARNESSES}:TerminalNotesEnv")) == [
        "append_note", "create_note", "list_note", "read_note", "shell_exec", "shell_kill_process", "shell_view",
        "shell_wait", "shell_write_content_to_file", "shell_write_to_process",
    ]  # fmt: skip
    pool = EnvironmentPool(HarborSpec(EXAMPLE_TASKS, agent=jupyter, environment_type=BW).environment_factory)
    assert pool.reward_functions() == []  # no get_reward: the spec's reward_funcs read env.reward

    class Mine(HarborEnv):
        pass

    assert HarborSpec(EXAMPLE_TASKS, agent=Mine).env_cls is Mine
    with pytest.raises(ValueError, match="Unknown agent 'zsh'"):
        resolve_agent("zsh")
    with pytest.raises(TypeError, match="must resolve to a HarborEnv subclass"):
        resolve_agent("posttrain.experimental.harbor:SandboxLimits")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        resolve_agent(f"{HARNESSES}:Nope")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_agent("no/such/file.py:Env")


def test_the_reward_reads_each_environment_or_the_workers_rewards():
    class Done:
        reward = 0.5

    assert _outcome_reward_func(environments=[Done(), Done()]) == [0.5, 0.5]
    assert _outcome_reward_func(environment_reward=[1, 0.25]) == [1.0, 0.25]
    with pytest.raises(ValueError, match="needs environments="):
        _outcome_reward_func()
    assert HarborBashEnv(environment_type=BW).reward == 0.0  # never reset: no verifier run


def test_malformed_task_directories_give_errors_naming_the_task(tmp_path):
    good = make_task(tmp_path, "good", "echo 1 > /logs/verifier/reward.txt\n")
    for name, breakage, message in [
        ("no-instruction", lambda t: (t / "instruction.md").unlink(), "has no instruction.md"),
        ("empty-instruction", lambda t: (t / "instruction.md").write_text("  \n"), "instruction.md is empty"),
        ("bad-toml", lambda t: (t / "task.toml").write_text("version = \n"), "task.toml is not valid TOML"),
        ("no-tests", lambda t: (t / "tests" / "test.sh").unlink(), r"has no tests/test.sh"),
        ("bad-timeout", lambda t: (t / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n"),
         r"\[verifier\] timeout_sec in task.toml must be a positive number"),
        ("bad-env", lambda t: (t / "task.toml").write_text("[verifier]\nenv = {A = 1}\n"),
         r"\[verifier\] env in task.toml must map names to strings"),
    ]:  # fmt: skip
        task = make_task(tmp_path / name, name, "echo 1 > /logs/verifier/reward.txt\n")
        breakage(task)
        with pytest.raises(HarborTaskError, match=rf"Harbor task '{name}' .*{message}"):
            HarborBashEnv(environment_type=BW).reset(task_dir=str(task))
    (tmp_path / "no-config").mkdir()
    (tmp_path / "no-config" / "instruction.md").write_text("x")
    with pytest.raises(HarborTaskError, match="'no-config' .*has no task.toml"):
        HarborBashEnv(environment_type=BW).reset(task_dir=str(tmp_path / "no-config"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HarborTaskError, match="No Harbor tasks under"):
        _ = HarborSpec(tmp_path / "empty").train_dataset
    with pytest.raises(HarborTaskError, match="is not a directory"):
        _ = HarborSpec(tmp_path / "missing" / "deeper" / "path").train_dataset
    with pytest.raises(ValueError, match="needs task_dir="):
        HarborBashEnv(environment_type=BW).reset(prompt=[])
    assert HarborSpec(good).train_dataset["task_name"] == ["good"]


def test_tasks_the_sandbox_cannot_run_are_refused_before_training(tmp_path):
    make_task(tmp_path, "installs", "#!/bin/bash\nset -e\npip install pytest\necho 1 > /logs/verifier/reward.txt\n")
    make_task(tmp_path, "downloads", "x=$(curl -s http://example.com)\n")
    make_task(
        tmp_path, "outside", "true\n", dockerfile="FROM x\nCOPY data.csv /opt/data.csv\n", files={"data.csv": "1"}
    )
    make_task(tmp_path, "remote", "true\n", dockerfile="FROM x\nWORKDIR /workdir\nADD https://x.org/f.txt .\n")
    make_task(tmp_path, "shebang", "#!/opt/nowhere/bin/zsh\ntrue\n")
    make_task(tmp_path, "workdir-tmp", "true\n", dockerfile="FROM x\nWORKDIR /tmp/app\n")
    expected = {
        "downloads": r"tests/test.sh line 1 runs 'curl', which needs the network",
        "installs": r"tests/test.sh line 3 runs 'pip'",
        "outside": r"copies to /opt/data.csv, outside the workspace /workdir",
        "remote": r"downloads https://x.org/f.txt; the bubblewrap sandbox has no network",
        "shebang": r"interpreter '/opt/nowhere/bin/zsh' is not on this host",
        "workdir-tmp": r"WORKDIR /tmp/app cannot hold the workspace .*overlaps a path the sandbox sets up",
    }
    for index, (name, message) in enumerate(sorted(expected.items())):
        with pytest.raises(HarborTaskError, match=rf"Harbor task '{name}'.*{message}"):
            _ = HarborSpec(tmp_path, environment_type=BW, indices=[index]).train_dataset
    # The same suite is fine for Harbor's own backends, which build the Dockerfile (no local check).
    assert HarborSpec(tmp_path).train_dataset.num_rows == 6
    # Copies are placed against the final WORKDIR (the workspace the agent gets), as the image would have them.
    ok = make_task(tmp_path / "ok", "late-workdir", "true\n", dockerfile="COPY a.txt /srv/\nWORKDIR /srv\n",
                   files={"a.txt": "a"})  # fmt: skip
    plan = plan_workspace(load_task(ok))
    assert plan.workdir == "/srv" and plan.copies == ((ok / "environment" / "a.txt", "a.txt"),)
    assert plan.ignored == ()


def test_harbor_backends_need_the_harbor_package_and_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "harbor", None)  # import harbor -> ImportError
    spec = HarborSpec(EXAMPLE_TASKS)  # TRL's default backend, docker
    assert spec.train_dataset.num_rows == 5  # reading the suite needs no harbor
    with pytest.raises(ImportError, match=r"pip install harbor.*Python >= 3\.12.*environment_type='bubblewrap'"):
        _ = spec.environment_factory
    with pytest.raises(ImportError, match=r"environment_type='e2b' .*pip install harbor"):
        HarborBashEnv(environment_type="e2b").reset(task_dir=str(EXAMPLE_TASKS / "hello-file"))


# --- the bubblewrap backend ----------------------------------------------------------------------------------------


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_every_example_task_scores_its_solution_and_not_doing_nothing():
    spec = HarborSpec(EXAMPLE_TASKS, environment_type=BW)
    factory = pickle.loads(pickle.dumps(spec.environment_factory))  # AsyncGRPO ships the factory to its worker
    for row in spec.train_dataset:
        idle, solver = factory(), factory()
        prompt = idle.reset(**row)
        assert prompt.startswith((EXAMPLE_TASKS / row["task_name"] / "instruction.md").read_text())
        assert prompt.endswith(HarborBashEnv.PROMPT_SUFFIX)
        assert idle.reward == 0.0, row["task_name"]
        solver.reset(**row)
        assert solver.bash(solution(row["task_name"])) == "(empty output, rc=0)"
        assert solver.reward == 1.0, row["task_name"]
        assert solver.reward == 1.0 and solver._sandbox.verifier_runs == 1  # the verifier ran once
        solver.reset(**row)  # a new rollout of the same task starts from the task's files again
        assert solver.reward == 0.0, row["task_name"]


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_tools_run_in_a_private_persistent_workspace_with_bounded_output_and_time(tmp_path):
    task = make_task(
        tmp_path, "t", "echo 0 > /logs/verifier/reward.txt\n", dockerfile="FROM x\nWORKDIR /work/app\nCOPY src/ lib/\n",
        files={"src/a.txt": "alpha\n", "src/deep/b.txt": "beta\n"},
    )  # fmt: skip
    env = _bash_env(task, command_timeout_s=2.0, max_output_chars=100)
    assert env.bash("pwd; cat lib/a.txt lib/deep/b.txt; id -u") == "/work/app\nalpha\nbeta\n1000\n"
    # Files persist across commands; /tmp and processes do not; the task's own tree is never touched.
    assert env.bash("echo kept > new.txt; echo gone > /tmp/t; echo changed > lib/a.txt") == "(empty output, rc=0)"
    assert env.bash("cat new.txt lib/a.txt; ls /tmp") == "kept\nchanged\n"
    assert (task / "environment" / "src" / "a.txt").read_text() == "alpha\n"
    assert env.bash("exit 3") == "(empty output, rc=3)"
    assert env.bash("echo out; echo err >&2") == "out\nerr\n"  # combined stdout+stderr
    long = env.bash("yes abc | head -c 100000")
    assert long.endswith("\n... [truncated]") and long.startswith("abc\nabc") and len(long) == 100 + 16
    assert env.bash("sleep 30") == "[the command timed out after 2 s and was stopped]"
    assert env.bash("(touch /usr/x; touch /etc/x; touch /x) 2>&1 | grep -c 'Read-only file system'") == "3\n"
    fresh = _bash_env(task)
    assert fresh.bash("cat new.txt 2>&1; cat lib/a.txt") == "cat: new.txt: No such file or directory\nalpha\n"


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_workspace_quota_and_agent_time_budget(tmp_path):
    task = make_task(tmp_path, "t", "echo 0 > /logs/verifier/reward.txt\n", dockerfile="COPY f.txt .\n",
                     files={"f.txt": "original\n"}, toml='[agent]\ntimeout_sec = 3.0\n')  # fmt: skip
    env = _bash_env(task, disk_mb=1, max_files=20)
    out = env.bash("head -c 2000000 /dev/zero > big; echo x > f.txt; echo wrote")
    assert out.startswith("wrote\n") and "grew past its quota (1 MB, 20 entries) and was reset" in out
    assert env.bash("ls; cat f.txt") == "f.txt\noriginal\n"  # back to the task's files
    assert "was reset" in env.bash("for i in $(seq 30); do touch n$i; done")
    # [agent] timeout_sec = 3: the rollout's commands may run 3 s in all, then are refused.
    env = _bash_env(task)
    assert env.bash("sleep 10") == "[the command timed out after 3 s and was stopped]"
    assert env.bash("echo hi") == "error: the agent's time budget for this task (3 s) is spent; no more commands run."


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_the_agent_cannot_read_host_files_outside_the_task(tmp_path):
    secret = tmp_path / "secret" / "token.txt"
    secret.parent.mkdir()
    secret.write_text("hunter2-host-secret\n")
    os.chmod(secret.parent, 0o755)
    os.chmod(secret, 0o644)  # readable by anyone on the host: only the sandbox keeps it out
    env = _bash_env(EXAMPLE_TASKS / "hello-file")
    out = env.bash(f"cat {secret}; ls {secret.parent}; ls {tmp_path}; cat /etc/passwd /etc/hostname; ls ~root")
    assert "hunter2" not in out and "No such file or directory" in out
    out = env.bash("find / -xdev -name token.txt 2>/dev/null; echo end")
    assert out == "end\n"
    assert env.bash(f"ls {EXAMPLE_TASKS} 2>&1 | head -1").startswith("ls: cannot access")  # the task tree too
    assert env.bash("ls /tests 2>&1") == "ls: cannot access '/tests': No such file or directory\n"  # the verifier's


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_the_agent_cannot_reach_the_network():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        env = _bash_env(EXAMPLE_TASKS / "hello-file")
        out = env.bash(
            f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\" 2>&1 | tail -1;"
            f" (echo hi > /dev/tcp/127.0.0.1/{port}) 2>&1; echo done"
        )
        assert "Network is unreachable" in out or "Connection refused" in out, out
        assert out.endswith("done\n")
        assert env.bash("python3 -c \"import socket; socket.getaddrinfo('huggingface.co', 443)\" 2>&1 | tail -1") \
            .startswith("socket.gaierror")  # fmt: skip
        readable, _, _ = select.select([listener], [], [], 0)
        assert readable == []  # no connection ever reached the host's listener
    finally:
        listener.close()


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_the_agent_cannot_forge_the_verifiers_reward():
    env = _bash_env(EXAMPLE_TASKS / "hello-file")
    # The verifier's directory does not exist while the agent runs, and the root is read-only.
    out = env.bash("mkdir -p /logs/verifier 2>&1; echo 1 > /logs/verifier/reward.txt 2>&1; echo tried")
    assert "Read-only file system" in out or "No such file or directory" in out
    # Where the agent can write: the workspace (also bound during the verifier run) and /tmp.
    env.bash(
        "mkdir -p logs/verifier && echo 1 > logs/verifier/reward.txt; echo 1 > reward.txt; "
        "echo '{\"reward\": 1}' > /tmp/reward.json; ln -s /etc/shadow reward.json"
    )
    # A daemon that would write the reward later dies with its command (every command has its own PID namespace).
    env.bash("setsid sh -c 'while :; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.01; done' "
             ">/dev/null 2>&1 < /dev/null & echo started")  # fmt: skip
    assert env.reward == 0.0  # the verifier's own verdict: hello.txt was never written
    # fix-mean's verifier imports the agent's stats.py; code planted there that writes the reward (at import, and
    # from a daemon) is outrun: the verifier kills what is left and writes its verdict last.
    env = _bash_env(EXAMPLE_TASKS / "fix-mean")
    planted = (
        "import subprocess\n"
        "open('/logs/verifier/reward.txt', 'w').write('1')\n"
        "subprocess.Popen(['sh', '-c', 'while :; do echo 1 > /logs/verifier/reward.txt; done'], "
        "start_new_session=True)\n"
        "def mean(values):\n    return 0\n"
    )
    assert env.bash(f"cat > stats.py << 'EOF'\n{planted}EOF\necho ok") == "ok\n"
    assert env.reward == 0.0


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_the_reward_file_is_read_outside_and_validated(tmp_path, caplog):
    cases = {
        "json": ("echo '{\"reward\": 0.75, \"extra\": \"x\"}' > /logs/verifier/reward.json", 0.75),
        "json-first": ("echo '{\"note\": \"x\", \"accuracy\": 0.25}' > /logs/verifier/reward.json", 0.25),
        "json-and-text": ("echo '{\"acc\": 0.1}' > /logs/verifier/reward.json; echo 0.9 > /logs/verifier/reward.txt",
                          0.9),
        "text": ("printf ' 0.5\\n' > /logs/verifier/reward.txt", 0.5),
        "env": ("echo $EXPECTED > /logs/verifier/reward.txt", 0.125),
    }  # fmt: skip
    for name, (script, want) in cases.items():
        toml = '[verifier]\nenv = { EXPECTED = "0.125" }\n' if name == "env" else 'version = "1.0"\n'
        assert _bash_env(make_task(tmp_path, name, script + "\n", toml=toml)).reward == want, name
    failures = {
        "missing": ("echo checking; exit 0", r"wrote neither /logs/verifier/reward.txt nor reward.json.*checking"),
        "nan": ("echo nan > /logs/verifier/reward.txt", r"the reward is not finite \(nan\)"),
        "word": ("echo great > /logs/verifier/reward.txt", r"reward.txt must hold one number, got 'great\\n'"),
        "list": ("echo '[1]' > /logs/verifier/reward.json", r"reward.json must be an object"),
        "empty": (": > /logs/verifier/reward.txt", r"/logs/verifier/reward.txt is empty"),
        "link": ("ln -s /etc/hostname /logs/verifier/reward.txt", r"reward.txt is not a regular file"),
    }
    for name, (script, message) in failures.items():
        toml = "[verifier]\ntimeout_sec = 1.0\n" if name == "slow" else 'version = "1.0"\n'
        env = _bash_env(make_task(tmp_path, name, script + "\n", toml=toml))
        with pytest.raises(HarborVerifierError, match=rf"(?s)Harbor task '{name}' .*{message}"):
            _ = env.reward
    # A verifier past its timeout scores 0 (what it runs may be the agent's endless loop): training goes on.
    slow = make_task(
        tmp_path, "slow", "echo 1 > /logs/verifier/reward.txt; sleep 30\n", toml="[verifier]\ntimeout_sec = 1.0\n"
    )
    with caplog.at_level(logging.WARNING, logger="posttrain.experimental.harbor"):
        assert _bash_env(slow).reward == 0.0
    assert "Harbor task 'slow': the verifier timed out after 1 s; the rollout scores 0.0." in caplog.text


@needs_bwrap
@pytest.mark.usefixtures("sandbox_lock")
def test_the_example_harnesses_keep_state_and_submit():
    spec = HarborSpec(EXAMPLE_TASKS, agent=f"{HARNESSES}:JupyterEnv", environment_type=BW, indices=[0])
    env = spec.environment_factory()
    assert "stateful kernel" in env.reset(**spec.train_dataset[0])
    assert env.add_and_execute_code_cell("x = 41\nprint('hi')") == "hi"
    assert env.add_and_execute_code_cell("x + 1") == "42"  # state persists across cells
    assert env.add_and_execute_code_cell("y = 1 / 0").endswith("ZeroDivisionError: division by zero\n")
    assert "NameError" in env.add_and_execute_code_cell("y")  # the failed cell left no state
    env.add_and_execute_code_cell("n = sum('ERROR' in line for line in open('app.log'))")
    assert env.execute_shell_command("ls") == "app.log\n"
    assert env.add_and_execute_code_cell("open('/workdir/answer.txt', 'w').write(str(n))\nn") == "4"
    assert env.reward == 1.0

    spec = HarborSpec(EXAMPLE_TASKS, agent=f"{HARNESSES}:TerminalNotesEnv", environment_type=BW, indices=[4])
    env = spec.environment_factory()
    env.reset(**spec.train_dataset[0])
    assert env.shell_exec("cat > in.txt; wc -c < in.txt", blocking=False) == "started background process p1"
    assert env.shell_write_to_process("p1", "hello") == "sent 5 characters to p1"
    assert env.shell_wait("p1") == "5\n" and env.shell_view("p1") == "5\n"
    assert env.shell_write_to_process("p1", "more").startswith("error: process p1 has already exited")
    assert env.shell_exec("cat in.txt") == "hello"
    assert env.create_note("plan", "write the config") == "created note 'plan'"
    assert env.append_note("plan", "; done") and env.read_note("plan") == "write the config; done"
    assert env.list_note() == "plan (22 characters)"
    config = '{"port": 8080, "debug": false, "name": "harbor"}'
    assert env.shell_write_content_to_file("/workdir/config.json", config).startswith("wrote 48 bytes")
    assert env.reward == 1.0
