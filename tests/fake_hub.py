"""A stand-in for the Hugging Face Hub's repository API, on commits (no hub is reachable here).

It keeps a repo as commits (a tree of path -> object per commit) and answers like the Hub does: small files with
their git blob id, large ones as LFS with their sha256, both computed from the bytes it received. It changes the
repo only through create_commit (the commit model: all of a commit's files or none), refuses a checkpoint commit
that does not carry every file its manifest names, can answer any call with a 429 (Retry-After) or a 5xx, and
counts the LFS objects the history still references (what a squash frees). Every call is checked against the
installed huggingface_hub's own signatures, so a renamed argument fails here, not on a GPU box.

With `state` (a folder) it keeps the repo there, so that several processes share it: an `ftrun` run in a
subprocess reaches it through sitecustomize.py (`install`), the test reads and changes it from outside.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import json
import sys
from pathlib import Path, PurePosixPath

import huggingface_hub as hf

from launcher.store import checkpoint as ckpt

REAL_API = hf.HfApi
LFS_ABOVE = 1024  # the stand-in stores files above this as LFS (the Hub: 10 MB or a binary type)


def hub_error(
    status: int, url: str = "https://huggingface.co/api/models/me/runs/commit/main", headers: dict | None = None
):
    """The exception huggingface_hub raises for this answer, made by its own hf_raise_for_status."""
    response_cls = hf.errors.Response
    request_cls = sys.modules[response_cls.__module__.split(".")[0]].Request
    response = response_cls(status, headers=headers or {}, request=request_cls("POST", url))
    try:
        hf.utils.hf_raise_for_status(response)
    except hf.errors.HfHubHTTPError as exc:
        return exc
    raise AssertionError(f"{status} raised nothing")


def not_found(what: str):
    """The error the Hub's 404 becomes (built from the response class huggingface_hub itself uses)."""
    response_cls = hf.errors.Response
    request_cls = sys.modules[response_cls.__module__.split(".")[0]].Request
    return hf.errors.RemoteEntryNotFoundError(
        f"404: {what}", response=response_cls(404, request=request_cls("GET", "https://huggingface.co/api/x"))
    )


def _shared(method):
    """An API call on the repo kept in `state`: under a lock, the state loaded before and saved after."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.state is None:
            return method(self, *args, **kwargs)
        with open(self.state / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.load()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.save()

    return call


class FakeHub:
    """HfApi's calls that launcher/store/sync/hub.py makes, on commits; `mangle` changes what an upload stores."""

    def __init__(self, state: Path | None = None):
        self.calls, self.mangle, self.offline = [], None, False
        self.commits: list[dict] = []  # {"message", "tree": {path: (oid, lfs)}, "added": [...], "deleted": [...]}
        self.made: list[dict] = []  # every commit ever made, squashed or not (what the tests count)
        self.objects: dict[str, bytes] = {}
        self.answers: list[dict] = []  # errors to answer with, in order: {"call", "status", "headers", "landed"}
        self.before_squash: list[set[str]] = []  # the LFS objects referenced when each squash began
        self.waits: list[dict] = []  # not the Hub's: what `ftrun status` said while the run waited (tests fill it)
        self.state = Path(state) if state is not None else None
        if self.state is not None:
            (self.state / "objects").mkdir(parents=True, exist_ok=True)
            if not (self.state / "repo.json").is_file():
                self.save()

    # -- kept in a folder, for several processes ----------------------------------------

    _FIELDS = ("calls", "commits", "made", "answers", "before_squash")

    def load(self) -> None:
        data = json.loads((self.state / "repo.json").read_text())
        self.calls, self.made, self.answers = data["calls"], data["made"], data["answers"]
        self.commits = [{**c, "tree": {p: tuple(v) for p, v in c["tree"].items()}} for c in data["commits"]]
        self.before_squash = [set(s) for s in data["before_squash"]]
        self.objects = _Objects(self.state / "objects")

    def save(self) -> None:
        data = {
            "calls": self.calls,
            "made": [{k: v for k, v in c.items() if k != "tree"} for c in self.made],
            "answers": self.answers,
            "commits": self.commits,
            "before_squash": [sorted(s) for s in self.before_squash],
        }
        tmp = self.state / "repo.json.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(self.state / "repo.json")
        if not isinstance(self.objects, _Objects):
            for oid, data in self.objects.items():
                (self.state / "objects" / oid).write_bytes(data)
            self.objects = _Objects(self.state / "objects")

    def reload(self) -> "FakeHub":
        """The repo as the other processes left it (for the test's own reading)."""
        with open(self.state / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.load()
        return self

    # -- the stand-in's own bookkeeping --------------------------------------------------

    def refuse(
        self,
        call: str,
        status: int,
        times: int = 1,
        headers: dict | None = None,
        landed: bool = False,
        message: str = "",
    ):
        """The next `times` calls of `call` answer `status` (`landed`: a commit applied, its answer lost; `message`:
        only commits whose message holds it)."""
        if self.state is not None:
            self.reload()
        self.answers += [
            {"call": call, "status": status, "headers": headers or {}, "landed": landed, "message": message}
        ] * times
        if self.state is not None:
            self.save()

    def _answer(self, name: str, kwargs: dict):
        if (
            self.answers
            and self.answers[0]["call"] == name
            and self.answers[0].get("message", "") in kwargs.get("commit_message", "")
        ):
            return self.answers.pop(0)
        return None

    def _check(self, name, *args, **kwargs):
        inspect.signature(getattr(REAL_API, name)).bind(None, *args, **kwargs)  # TypeError on a wrong argument
        self.calls.append(name)
        answer = self._answer(name, kwargs)
        if answer and not answer["landed"]:
            raise hub_error(answer["status"], headers=answer["headers"])
        return answer

    @property
    def head(self) -> dict:
        return self.commits[-1]["tree"] if self.commits else {}

    def lfs_referenced(self) -> set[str]:
        """The LFS objects some commit of the history references: what the repo's storage counts."""
        return {oid for c in self.commits for oid, lfs in c["tree"].values() if lfs}

    def ls(self, folder: str) -> list[str]:
        """The names directly in a folder of the branch's head."""
        return sorted(path.rsplit("/", 1)[-1] for path in self._children(folder))

    def read(self, path: str) -> bytes:
        return self.objects[self.head[path][0]]

    def commits_adding(self, path_prefix: str) -> list[dict]:
        return [c for c in self.made if any(p.startswith(path_prefix) for p in c["added"])]

    def __getattr__(self, name):  # upload_file, upload_folder, delete_folder ...: not the commit model
        raise AssertionError(f"HfApi.{name} called: every change to the repo must be one create_commit")

    # -- HfApi ---------------------------------------------------------------------------

    @_shared
    def create_repo(self, *args, **kwargs):
        self._check("create_repo", *args, **kwargs)

    @_shared
    def create_commit(self, *args, **kwargs):
        answer = self._check("create_commit", *args, **kwargs)
        operations = list(args[1] if len(args) > 1 else kwargs["operations"])
        tree = dict(self.head)
        added, deleted = [], []
        for op in operations:
            if isinstance(op, hf.CommitOperationDelete):
                path = op.path_in_repo.rstrip("/")
                gone = [p for p in tree if p == path or p.startswith(path + "/")]
                if not gone:
                    raise not_found(f"{path}: A file with this name doesn't exist")
                for p in gone:
                    del tree[p]
                deleted.append(path)
            else:
                assert isinstance(op, hf.CommitOperationAdd), op
                if op._is_committed:
                    raise ValueError(f"CommitOperationAdd {op} has already being committed")
                data = Path(op.path_or_fileobj).read_bytes()
                data = self.mangle(op.path_in_repo, data) if self.mangle else data
                lfs = len(data) > LFS_ABOVE
                oid = (
                    hashlib.sha256(data).hexdigest()
                    if lfs
                    else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                )
                self.objects[oid] = data
                tree[op.path_in_repo] = (oid, lfs)
                added.append(op.path_in_repo)
        for path in added:  # a manifest arrives with all the files it names, in the same commit
            if PurePosixPath(path).name == ckpt.MANIFEST:
                folder = path.rsplit("/", 1)[0]
                named = json.loads(self.objects[tree[path][0]])["files"]
                missing = [n for n in named if f"{folder}/{n}" not in added]
                assert not missing, f"commit adds {path} without {missing}"
        if tree != self.head:  # huggingface_hub skips a commit that changes nothing
            self.commits.append({"message": kwargs["commit_message"], "tree": tree, "added": added, "deleted": deleted})
            self.made.append(self.commits[-1])
        for op in operations:
            if isinstance(op, hf.CommitOperationAdd):
                op._is_committed = True
        if answer:  # applied, but the answer is lost on the way back
            raise hub_error(answer["status"], headers=answer["headers"])

    @_shared
    def super_squash_history(self, *args, **kwargs):
        self._check("super_squash_history", *args, **kwargs)
        self.before_squash.append(self.lfs_referenced())
        self.commits = [
            {"message": kwargs.get("commit_message") or "squash", "tree": dict(self.head), "added": [], "deleted": []}
        ]

    @_shared
    def hf_hub_download(self, *args, **kwargs):
        self._check("hf_hub_download", *args, **kwargs)
        repo_id, filename = args
        if self.offline:  # what hf_hub_download raises when the Hub does not answer
            raise hf.errors.LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub")
        if filename not in self.head:
            raise not_found(f"{filename} not in {repo_id}")
        assert kwargs.get("local_dir"), "downloads must not go through the global Hub cache"
        dst = Path(kwargs["local_dir"]) / filename
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(self.objects[self.head[filename][0]])
        return str(dst)

    def _children(self, folder: str) -> dict[str, bool]:
        """{path: is_folder} of the head's entries directly in `folder` ("" is the root)."""
        out = {}
        for path in self.head:
            rest = path[len(folder) + 1 :] if folder else path
            if folder and not path.startswith(folder + "/"):
                continue
            first, _, more = rest.partition("/")
            out[f"{folder}/{first}" if folder else first] = bool(more)
        return out

    @_shared
    def list_repo_tree(self, *args, **kwargs):
        self._check("list_repo_tree", *args, **kwargs)
        folder = kwargs.get("path_in_repo") or ""
        children = self._children(folder)
        if folder and not children:
            raise not_found(folder)
        return [
            hf.hf_api.RepoFolder(path=path, oid="0" * 40) if is_folder else self._info(path)
            for path, is_folder in sorted(children.items())
        ]

    @_shared
    def get_paths_info(self, *args, **kwargs):
        self._check("get_paths_info", *args, **kwargs)
        assert 0 < len(args[1]) <= 1000, "the Hub takes 1 to 1,000 paths per call"
        out = []
        for p in args[1]:
            if p in self.head:
                out.append(self._info(p))
            elif any(q.startswith(p + "/") for q in self.head):
                out.append(hf.hf_api.RepoFolder(path=p, oid="0" * 40))
        return out

    def _info(self, path: str):
        oid, lfs = self.head[path]
        data = self.objects[oid]
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return hf.hf_api.RepoFile(
            path=path,
            size=len(data),
            oid=blob,
            lfs={"size": len(data), "oid": oid, "pointerSize": 134} if lfs else None,
        )


class _Objects(dict):
    """The object store of a repo kept in a folder: one file per object id."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __setitem__(self, oid: str, data: bytes) -> None:
        (self.folder / oid).write_bytes(data)

    def __getitem__(self, oid: str) -> bytes:
        return (self.folder / oid).read_bytes()


SITECUSTOMIZE = """
import os
if os.environ.get("FTRUN_TEST_FAKE_HUB"):
    import sys
    sys.path.insert(0, {tests!r})
    import huggingface_hub
    from fake_hub import FakeHub
    _hub = FakeHub(os.environ["FTRUN_TEST_FAKE_HUB"])

    class _HfApi(huggingface_hub.HfApi):  # a class still (transformers writes `HfApi | None`), made the stand-in
        def __new__(cls, *args, **kwargs):
            return _hub

    huggingface_hub.HfApi = _HfApi
"""


def install(folder: Path) -> Path:
    """A sitecustomize.py in `folder` that gives every Python process started with FTRUN_TEST_FAKE_HUB=<state>
    on its path this stand-in for HfApi; returns the folder (for PYTHONPATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tests=str(Path(__file__).resolve().parent)))
    return folder
