"""Tests for quotawrap.books.attribution: automatic tags from a whitelist (user, host, git, CI)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from quotawrap.books.attribution import GIT_TIMEOUT_S, automatic_tags, run_git

GITHUB_ENV = {
    "GITHUB_ACTIONS": "true",
    "GITHUB_RUN_ID": "9876543210",
    "GITHUB_JOB": "test",
    "GITHUB_ACTOR": "octocat",
    "GITHUB_WORKFLOW": "CI",
    "GITHUB_REPOSITORY": "acme/agent",
    "GITHUB_REF_NAME": "main",
}
GITLAB_ENV = {
    "GITLAB_CI": "true",
    "CI_PIPELINE_ID": "555",
    "CI_JOB_ID": "777",
    "CI_JOB_NAME": "unit",
    "GITLAB_USER_LOGIN": "alice",
    "CI_PROJECT_PATH": "group/project",
    "CI_COMMIT_REF_NAME": "feature/x",
}
SECRETS = {
    "GITHUB_TOKEN": "ghs_SECRET1",
    "ACTIONS_RUNTIME_TOKEN": "SECRET2",
    "ARK_API_KEY": "ark-SECRET3",
    "CI_JOB_TOKEN": "glcbt-SECRET4",
    "OPENAI_API_KEY": "sk-SECRET5",
    "AWS_SECRET_ACCESS_KEY": "SECRET6",
}


class FakeGit:
    """Answers git queries from a table and records the timeouts it was given."""

    def __init__(self, branch: str | None = "main", commit: str | None = "abc1234") -> None:
        self.answers = {"symbolic-ref": branch, "rev-parse": commit}
        self.calls: list[tuple[tuple[str, ...], str | None, float]] = []

    def __call__(self, args: Sequence[str], cwd: str | None, timeout: float) -> str | None:
        self.calls.append((tuple(args), cwd, timeout))
        return self.answers.get(args[0])


def no_git(args: Sequence[str], cwd: str | None, timeout: float) -> str | None:
    return None


def fixed_host() -> str:
    return "build-7"


def tags_for(environ: dict[str, str], git: Any = no_git) -> dict[str, str]:
    return automatic_tags(environ, "/repo", run_git=git, hostname=fixed_host)


class TestAutomaticTags:
    """User, host, git and CI tags from injected sources."""

    def test_user_and_host(self) -> None:
        """The user comes from the environment like getpass.getuser, the host from gethostname."""
        tags = tags_for({"LOGNAME": "bob", "USER": "other"})
        assert tags["user"] == "bob"
        assert tags["host"] == "build-7"

    def test_user_falls_back_to_the_account(self) -> None:
        """Without user variables the account name is looked up, not left empty."""
        assert tags_for({}).get("user")

    def test_git_branch_and_commit(self) -> None:
        """Branch and short commit come from git in the given directory."""
        git = FakeGit(branch="feature/x", commit="1a2b3c4")
        tags = tags_for({}, git)
        assert (tags["git_branch"], tags["git_commit"]) == ("feature/x", "1a2b3c4")
        assert {cwd for _, cwd, _ in git.calls} == {"/repo"}

    def test_git_queries_share_the_timeout(self) -> None:
        """Every git call gets at most the 2 s budget, and the budget shrinks."""
        git = FakeGit()
        tags_for({}, git)
        timeouts = [timeout for _, _, timeout in git.calls]
        assert len(timeouts) == 2
        assert all(0 < timeout <= GIT_TIMEOUT_S for timeout in timeouts)
        assert timeouts[1] <= timeouts[0]

    def test_missing_git_is_omitted(self) -> None:
        """No git (or not a repository) means no git tags, not empty ones."""
        tags = tags_for({}, no_git)
        assert "git_branch" not in tags and "git_commit" not in tags

    def test_detached_head_has_commit_only(self) -> None:
        """On a detached HEAD the branch is left out rather than guessed."""
        tags = tags_for({}, FakeGit(branch=None, commit="abc1234"))
        assert "git_branch" not in tags and tags["git_commit"] == "abc1234"

    def test_github_actions(self) -> None:
        """GitHub Actions variables map to the short ci_* keys."""
        tags = tags_for(GITHUB_ENV)
        assert {key: value for key, value in tags.items() if key.startswith("ci")} == {
            "ci": "github",
            "ci_run_id": "9876543210",
            "ci_job": "test",
            "ci_actor": "octocat",
            "ci_workflow": "CI",
            "ci_repo": "acme/agent",
            "ci_ref": "main",
        }

    def test_gitlab_ci(self) -> None:
        """GitLab CI variables map to the same keys, plus the job id."""
        tags = tags_for(GITLAB_ENV)
        assert {key: value for key, value in tags.items() if key.startswith("ci")} == {
            "ci": "gitlab",
            "ci_run_id": "555",
            "ci_job": "unit",
            "ci_job_id": "777",
            "ci_actor": "alice",
            "ci_repo": "group/project",
            "ci_ref": "feature/x",
        }

    def test_not_in_ci(self) -> None:
        """Outside CI there are no ci tags at all."""
        assert not any(key.startswith("ci") for key in tags_for({"CI": "true"}))

    def test_missing_ci_variables_are_omitted(self) -> None:
        """A CI system with some variables unset yields only the present ones."""
        tags = tags_for({"GITHUB_ACTIONS": "true", "GITHUB_RUN_ID": "1", "GITHUB_JOB": ""})
        assert tags["ci_run_id"] == "1" and "ci_job" not in tags

    def test_secrets_never_leak(self) -> None:
        """Tokens and API keys in the environment appear in no tag key or value."""
        environ = {**GITHUB_ENV, **GITLAB_ENV, **SECRETS, "LOGNAME": "bob"}
        tags = tags_for(environ, FakeGit())
        text = repr(tags)
        for name, secret in SECRETS.items():
            assert secret not in text
            assert name.lower() not in text.lower()

    def test_only_whitelisted_keys(self) -> None:
        """Automatic tags use only the documented keys, whatever the environment holds."""
        environ = {**GITHUB_ENV, **SECRETS, "GITHUB_EVENT_PATH": "/x", "LOGNAME": "bob"}
        allowed = {"user", "host", "git_branch", "git_commit", "ci", "ci_run_id", "ci_job", "ci_job_id"}
        allowed |= {"ci_actor", "ci_workflow", "ci_repo", "ci_ref"}
        assert set(tags_for(environ, FakeGit())) <= allowed

    def test_control_characters_are_stripped(self) -> None:
        """A CI value with a newline cannot break a one-line report."""
        tags = tags_for({"GITHUB_ACTIONS": "true", "GITHUB_REF_NAME": "evil\nline", "LOGNAME": "b\x1bob"})
        assert tags["ci_ref"] == "evilline" and tags["user"] == "bob"

    def test_host_failure_is_omitted(self) -> None:
        """A failing gethostname leaves host out instead of raising."""

        def broken() -> str:
            raise OSError("no hostname")

        assert "host" not in automatic_tags({}, run_git=no_git, hostname=broken)


def _git(path: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=path,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
class TestRealGit:
    """The default git runner against real repositories."""

    def test_branch_and_commit(self, tmp_path: Path) -> None:
        """In a repository with a commit, the branch and short commit are the ones git reports."""
        _git(tmp_path, "init", "--quiet", "--initial-branch=trunk")
        _git(tmp_path, "commit", "--quiet", "--allow-empty", "-m", "first")
        tags = automatic_tags({}, str(tmp_path))
        assert tags["git_branch"] == "trunk"
        assert tags["git_commit"] == _git(tmp_path, "rev-parse", "--short", "HEAD")

    def test_before_the_first_commit(self, tmp_path: Path) -> None:
        """A fresh repository has a branch but no commit yet."""
        _git(tmp_path, "init", "--quiet", "--initial-branch=trunk")
        tags = automatic_tags({}, str(tmp_path))
        assert tags["git_branch"] == "trunk" and "git_commit" not in tags

    def test_detached_head(self, tmp_path: Path) -> None:
        """A detached checkout (as CI often makes) gives the commit and no branch."""
        _git(tmp_path, "init", "--quiet")
        _git(tmp_path, "commit", "--quiet", "--allow-empty", "-m", "first")
        _git(tmp_path, "checkout", "--quiet", "--detach")
        tags = automatic_tags({}, str(tmp_path))
        assert "git_branch" not in tags and tags["git_commit"]

    def test_not_a_repository(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """Outside any repository there are no git tags."""
        monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # in case tmp sits inside a checkout
        tags = automatic_tags({}, str(tmp_path))
        assert "git_branch" not in tags and "git_commit" not in tags

    def test_git_missing_from_path(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """With no git executable the runner returns None instead of raising."""
        monkeypatch.setenv("PATH", str(tmp_path))
        assert run_git(["rev-parse", "--short", "HEAD"], str(tmp_path), GIT_TIMEOUT_S) is None

    def test_no_time_left(self, tmp_path: Path) -> None:
        """A spent budget skips git entirely."""
        assert run_git(["--version"], str(tmp_path), 0) is None
