import pytest

from mounting import CkptMount, HAVE_FUSE


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs /dev/fuse and root")
    for item in items:
        if "mount" in item.keywords and not HAVE_FUSE:
            item.add_marker(skip)


@pytest.fixture
def ckpt(tmp_path):
    """A live ckptfs mount over two 1 GiB file-backed devices, 512M of memory."""
    m = CkptMount(tmp_path)
    m.mount()
    try:
        yield m
    finally:
        m.close()


@pytest.fixture
def ckpt_factory(tmp_path):
    """Make mounts with custom settings: ckpt_factory(memory="64M", ndev=4)."""
    made = []

    def make(**kw):
        m = CkptMount(tmp_path / f"m{len(made)}", **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()
