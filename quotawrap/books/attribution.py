"""Who and what a run's spend belongs to: ``--tag KEY=VALUE`` plus tags found automatically.

Automatic tags come from a fixed whitelist and nothing else: the user, the host, the git
branch and short commit of the working directory, and a handful of named GitHub Actions /
GitLab CI variables. The environment is never scanned by pattern, so tokens and API keys
(``GITHUB_TOKEN``, ``CI_JOB_TOKEN``, ``ARK_API_KEY`` ...) cannot end up in a ledger or report.

Keys are short and prefix-free: ``user``, ``host``, ``git_branch``, ``git_commit``, ``ci``,
``ci_run_id``, ``ci_job``, ``ci_job_id`` (GitLab), ``ci_actor``, ``ci_workflow`` (GitHub),
``ci_repo``, ``ci_ref``. Explicit tags win over automatic ones of the same key.
"""

from __future__ import annotations

import os
import time

from ..core.tags import clean_tag_value

# Every guarded command asks for its tags before its child starts: no typing, re or subprocess here.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from typing import Final

    #: ``run_git(args, cwd, timeout)``: git's stripped stdout, or None when git failed or is absent.
    RunGit = Callable[[Sequence[str], str | None, float], str | None]

__all__ = [
    "GIT_TIMEOUT_S",
    "WRAPPER_HOST_TAG",
    "WRAPPER_PID_TAG",
    "automatic_tags",
    "begin_automatic_tags",
    "run_git",
]


GIT_TIMEOUT_S: Final = 2.0  # for all git calls together: attribution must never stall a run
# Tags of the run's record only (not of its calls): the wrapper that owns the run, so `status` can
# tell a run whose wrapper died from one still going.
WRAPPER_PID_TAG: Final = "wrapper_pid"
WRAPPER_HOST_TAG: Final = "wrapper_host"
_GIT_QUERIES: Final = (
    # symbolic-ref names the branch even before the first commit, and fails on a detached HEAD,
    # where a branch name would be a guess
    ("git_branch", ("symbolic-ref", "--quiet", "--short", "HEAD")),
    ("git_commit", ("rev-parse", "--short", "HEAD")),
)

# (environment variable, tag key): the only variables ever read, per CI system
_GITHUB: Final = (
    ("GITHUB_RUN_ID", "ci_run_id"),
    ("GITHUB_JOB", "ci_job"),
    ("GITHUB_ACTOR", "ci_actor"),
    ("GITHUB_WORKFLOW", "ci_workflow"),
    ("GITHUB_REPOSITORY", "ci_repo"),
    ("GITHUB_REF_NAME", "ci_ref"),
)
_GITLAB: Final = (
    ("CI_PIPELINE_ID", "ci_run_id"),
    ("CI_JOB_NAME", "ci_job"),
    ("CI_JOB_ID", "ci_job_id"),
    ("GITLAB_USER_LOGIN", "ci_actor"),
    ("CI_PROJECT_PATH", "ci_repo"),
    ("CI_COMMIT_REF_NAME", "ci_ref"),
)
_USER_VARIABLES: Final = ("LOGNAME", "USER", "LNAME", "USERNAME")  # getpass.getuser's order


def run_git(args: Sequence[str], cwd: str | None, timeout: float) -> str | None:
    """Run one read-only git query; None on any failure (no git, not a repository, timeout)."""
    if timeout <= 0:
        return None
    import subprocess  # only here: the wrapper's start-up does not wait for it

    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    try:
        done = subprocess.run(
            # fsmonitor off: a repository's config must not get to run a program on our behalf
            ["git", "-c", "core.fsmonitor=false", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def automatic_tags(
    environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    *,
    run_git: RunGit | None = None,
    hostname: Callable[[], str] | None = None,
) -> dict[str, str]:
    """Tags every run gets without asking: user, host, git branch/commit, CI identifiers.

    ``environ`` defaults to ``os.environ`` and ``cwd`` to the current directory. Whatever
    cannot be found (no git, detached HEAD, no commits yet, not in CI) is left out, never
    guessed. The git queries share a :data:`GIT_TIMEOUT_S` budget; ``run_git`` (tests) asks
    them one after the other instead of both at once.
    """
    if run_git is None:
        return begin_automatic_tags(environ, cwd, hostname=hostname)()
    tags = _plain_tags(environ, hostname)
    deadline = time.monotonic() + GIT_TIMEOUT_S
    for key, args in _GIT_QUERIES:
        _put(tags, key, run_git(args, cwd, deadline - time.monotonic()))
    return {**tags, **_ci_tags(os.environ if environ is None else environ)}


def begin_automatic_tags(
    environ: Mapping[str, str] | None = None, cwd: str | None = None, *, hostname: Callable[[], str] | None = None
) -> Callable[[], dict[str, str]]:
    """:func:`automatic_tags`, its git queries started now (both at once, no thread, no subprocess
    module); call the result for the tags. The wrapper starts them first and collects them just
    before it records its run, so the two git processes run beside the wrapper's own start."""
    started = time.monotonic()
    queries = [(key, _spawn_git(args, cwd)) for key, args in _GIT_QUERIES]

    def finish() -> dict[str, str]:
        tags = _plain_tags(environ, hostname)
        deadline = started + GIT_TIMEOUT_S
        for key, spawned in queries:
            _put(tags, key, _git_answer(spawned, deadline))
        return {**tags, **_ci_tags(os.environ if environ is None else environ)}

    return finish


def _plain_tags(environ: Mapping[str, str] | None, hostname: Callable[[], str] | None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    tags: dict[str, str] = {}
    _put(tags, "user", _user(env))
    if hostname is None:
        from ..support.host import hostname as machine_name  # socket.gethostname's answer, without importing socket

        hostname = machine_name
    _put(tags, "host", _host(hostname))
    return tags


def _spawn_git(args: Sequence[str], cwd: str | None) -> tuple[int, int] | None:
    """One read-only git query started: (pid, the read end of its stdout), or None (no git)."""
    from ..support.processes import which

    git = which("git")
    if git is None:
        return None
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    # fsmonitor off: a repository's config must not get to run a program on our behalf
    argv = ["git", *(["-C", cwd] if cwd is not None else []), "-c", "core.fsmonitor=false", *args]
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawn(
            git,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, write_end, 1),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
        )
    except OSError:
        os.close(read_end)
        return None
    finally:
        os.close(write_end)
    return pid, read_end


def _git_answer(spawned: tuple[int, int] | None, deadline: float) -> str | None:
    """The query's stripped stdout once it exits 0 before ``deadline``; None otherwise (killed at the deadline)."""
    if spawned is None:
        return None
    import select

    pid, read_end = spawned
    chunks: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                with _suppress_oserror():
                    os.kill(pid, 9)  # SIGKILL, as subprocess.run's timeout does
                os.waitpid(pid, 0)
                return None
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
    except (OSError, ValueError):
        return None
    finally:
        os.close(read_end)
    if os.waitstatus_to_exitcode(status) != 0:
        return None
    try:
        return b"".join(chunks).decode().strip() or None
    except UnicodeDecodeError:
        return None


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


# --------------------------------------------------------------------------- sources


def _user(environ: Mapping[str, str]) -> str | None:
    # getpass.getuser() with the environment injectable; it raises rather than returns on some systems
    for name in _USER_VARIABLES:
        value = environ.get(name)
        if value:
            return value
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError, OSError, AttributeError):
        return None


def _host(hostname: Callable[[], str]) -> str | None:
    try:
        return hostname()
    except OSError:
        return None


def _ci_tags(environ: Mapping[str, str]) -> dict[str, str]:
    if environ.get("GITHUB_ACTIONS") == "true" or environ.get("GITHUB_RUN_ID"):
        system, variables = "github", _GITHUB
    elif environ.get("GITLAB_CI") == "true" or environ.get("CI_PIPELINE_ID"):
        system, variables = "gitlab", _GITLAB
    else:
        return {}
    tags = {"ci": system}
    for variable, key in variables:
        _put(tags, key, environ.get(variable))
    return tags


def _put(tags: dict[str, str], key: str, value: str | None) -> None:
    """Add a found value, made safe for a one-line report; drop it when nothing is left."""
    if value is None:
        return
    cleaned = clean_tag_value(value)
    if cleaned:
        tags[key] = cleaned
