"""Two richer Harbor harnesses (TRL's ``jupyter`` and ``terminal_notes`` examples), as ``HarborEnv`` subclasses.

Select one with ``HarborSpec(dataset, agent="examples/harbor_harnesses.py:JupyterEnv")`` (or ``:TerminalNotesEnv``).
Both use only ``self._exec`` (one shell command in the task's sandbox), so they run on every backend: posttrain's
``"bubblewrap"`` sandbox, where no process outlives a tool call, as well as Harbor's containers.

- ``JupyterEnv``: a *stateful* Python "kernel" -- variables, imports and definitions persist across cells -- plus a
  shell tool. Since a process cannot outlive a call here, the state is rebuilt for each cell by re-running the
  cells that succeeded before it, their output discarded (so earlier cells should not append to files: they run
  again). The last expression of a cell is shown, as in a notebook.
- ``TerminalNotesEnv``: six shell tools (including "background" processes) and four note tools whose notes live in
  the environment for the rollout. A non-blocking ``shell_exec`` is *deferred*: it runs, fed what
  ``shell_write_to_process`` sent it as stdin, when ``shell_view`` or ``shell_wait`` asks for its output (a portable
  subset: it cannot run alongside the next command).

Both submit like the ``bash`` harness: the answer goes to ``/workdir/answer.txt``.
"""

from __future__ import annotations

import base64
import json
import shlex

from posttrain.experimental.harbor import HarborEnv

_CELL_OK = "__posttrain_cell_ok__"

# Runs in the sandbox: replays the earlier cells silently, then runs the new one (showing its last expression).
_KERNEL = r"""
import ast, base64, contextlib, io, json, sys, traceback
cells = json.loads(base64.b64decode(sys.argv[1]))
ns = {"__name__": "__main__"}
for cell in cells[:-1]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(cell, "<cell>", "exec"), ns)
        except Exception:
            pass
try:
    tree = ast.parse(cells[-1])
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
        if value is not None:
            print(repr(value))
except Exception:
    traceback.print_exc(limit=-1)
    sys.exit(1)
print("\n" + MARK)
""".replace("MARK", repr(_CELL_OK))


class JupyterEnv(HarborEnv):
    """A stateful Python kernel (variables persist across cells) and a shell."""

    PROMPT_SUFFIX = (
        "\n\nTools: `add_and_execute_code_cell` runs Python in a stateful kernel (variables and imports persist "
        "across cells; the last expression is shown); `execute_shell_command` runs a shell command (not stateful). "
        "The working directory is /workdir. Submit an answer by writing it to /workdir/answer.txt, e.g. "
        "`open('/workdir/answer.txt', 'w').write(str(answer))`."
    )

    def _setup(self) -> None:
        self._cells: list[str] = []

    def add_and_execute_code_cell(self, code: str) -> str:
        """Execute Python code in the stateful kernel; variables, imports and definitions persist across calls.

        Args:
            code: The Python code of the cell.

        Returns:
            The cell's output (and the value of its last expression), or the error it raised.
        """
        cells = [*self._cells, code]
        payload = base64.b64encode(json.dumps(cells).encode()).decode()
        out = self._exec(f"python3 -c {shlex.quote(_KERNEL)} {payload}")
        ok = out.rstrip().endswith(_CELL_OK)
        if ok:
            self._cells.append(code)  # only cells that ran are replayed
            out = out.rstrip()[: -len(_CELL_OK)].rstrip("\n")
        return out or "(no output)"

    def execute_shell_command(self, command: str) -> str:
        """Run a shell command (ls, cat, ...); it does not share state with the Python kernel.

        Args:
            command: The shell command to run.

        Returns:
            Its combined stdout and stderr.
        """
        return self._exec(command)


class TerminalNotesEnv(HarborEnv):
    """Six shell tools (with deferred background processes) and a note toolkit kept for the rollout."""

    PROMPT_SUFFIX = (
        "\n\nShell tools: `shell_exec` (blocking=false starts a background process and returns its id), "
        "`shell_write_content_to_file`, `shell_write_to_process`, `shell_view`, `shell_wait`, `shell_kill_process`. "
        "Note tools: `create_note`, `append_note`, `read_note`, `list_note` (notes are not shown to you again "
        "unless you read them). Submit an answer with "
        '`shell_write_content_to_file(path="/workdir/answer.txt", content="<value>")`.'
    )

    def _setup(self) -> None:
        self._notes: dict[str, str] = {}
        self._processes: dict[str, dict] = {}

    # -- shell

    def shell_exec(self, command: str, blocking: bool = True) -> str:
        """Run a shell command in the sandbox.

        Args:
            command: The shell command.
            blocking: True: wait and return its output. False: start it in the background and return its id.

        Returns:
            The output (blocking) or the background process's id.
        """
        if blocking:
            return self._exec(command)
        pid = f"p{len(self._processes) + 1}"
        self._processes[pid] = {"command": command, "stdin": "", "output": None}
        return f"started background process {pid}"

    def shell_write_content_to_file(self, path: str, content: str) -> str:
        """Write text to a file (parent directories are created), replacing what it held.

        Args:
            path: The file's path, e.g. /workdir/answer.txt.
            content: The text to write.

        Returns:
            A confirmation, or the error.
        """
        data = base64.b64encode(content.encode()).decode()
        quoted = shlex.quote(path)
        return self._exec(
            f'mkdir -p "$(dirname {quoted})" && printf %s {data} | base64 -d > {quoted} '
            f"&& echo wrote {len(content.encode())} bytes to {quoted}"
        )

    def _process(self, pid: str) -> dict | None:
        return self._processes.get(pid)

    def shell_write_to_process(self, pid: str, content: str) -> str:
        """Send text to a background process's standard input.

        Args:
            pid: The id shell_exec returned.
            content: The text to send.

        Returns:
            A confirmation, or why it could not be sent.
        """
        process = self._process(pid)
        if process is None:
            return f"error: no background process {pid!r}"
        if process["output"] is not None:
            return f"error: process {pid} has already exited"
        process["stdin"] += content
        return f"sent {len(content)} characters to {pid}"

    def _finish(self, process: dict) -> str:
        if process["output"] is None:
            data = base64.b64encode(process["stdin"].encode()).decode()
            command = f"printf %s {data} | base64 -d | ( {process['command']}\n)"
            process["output"] = self._exec(command)
        return process["output"]

    def shell_view(self, pid: str) -> str:
        """Show the output of a background process.

        Args:
            pid: The id shell_exec returned.

        Returns:
            Its combined stdout and stderr.
        """
        process = self._process(pid)
        return f"error: no background process {pid!r}" if process is None else self._finish(process)

    def shell_wait(self, pid: str) -> str:
        """Wait for a background process to exit and return its output.

        Args:
            pid: The id shell_exec returned.

        Returns:
            Its combined stdout and stderr.
        """
        return self.shell_view(pid)

    def shell_kill_process(self, pid: str) -> str:
        """Stop a background process.

        Args:
            pid: The id shell_exec returned.

        Returns:
            A confirmation.
        """
        process = self._processes.pop(pid, None)
        if process is None:
            return f"error: no background process {pid!r}"
        return f"process {pid} had already exited" if process["output"] is not None else f"killed {pid}"

    # -- notes

    def create_note(self, title: str, content: str) -> str:
        """Create a note.

        Args:
            title: The note's title.
            content: Its text.

        Returns:
            A confirmation, or an error if a note with this title exists.
        """
        if title in self._notes:
            return f"error: a note titled {title!r} exists; use append_note"
        self._notes[title] = content
        return f"created note {title!r}"

    def append_note(self, title: str, content: str) -> str:
        """Append text to an existing note.

        Args:
            title: The note's title.
            content: The text to append.

        Returns:
            A confirmation, or an error if there is no such note.
        """
        if title not in self._notes:
            return f"error: no note titled {title!r}"
        self._notes[title] += content
        return f"appended {len(content)} characters to {title!r}"

    def read_note(self, title: str) -> str:
        """Read a note.

        Args:
            title: The note's title.

        Returns:
            Its text, or an error if there is no such note.
        """
        return self._notes.get(title, f"error: no note titled {title!r}")

    def list_note(self) -> str:
        """List the notes' titles and sizes.

        Returns:
            One line per note, or "(no notes)".
        """
        return "\n".join(f"{t} ({len(c)} characters)" for t, c in self._notes.items()) or "(no notes)"
