"""Local files for streamed uploads and downloads."""

from __future__ import annotations

import os
from typing import IO, AsyncIterator, Callable, Iterable, Iterator, Optional, Union

CHUNK = 1 << 20
Source = Union[str, "os.PathLike[str]", IO[bytes]]
"""A local path, or a binary file object open for reading."""
Sink = Union[str, "os.PathLike[str]", IO[bytes]]
"""A local path, or a binary file object open for writing."""


def size_of(source: Source) -> Optional[int]:
    """Bytes left to send, when known."""
    if isinstance(source, (str, os.PathLike)):
        return os.path.getsize(source)
    try:
        pos = source.tell()
        return os.fstat(source.fileno()).st_size - pos
    except (OSError, AttributeError, ValueError):
        return None


def replayable(source: Source) -> bool:
    """Whether `source` can be read again from the start (a retry)."""
    return isinstance(source, (str, os.PathLike)) or source.seekable()


def chunks_of(source: Source, chunk_size: int = CHUNK) -> Callable[[], Iterator[bytes]]:
    """A function making a fresh iterator over the bytes of `source` (a
    file object is read from where it stood when this was called)."""
    if isinstance(source, (str, os.PathLike)):
        path = source

        def from_path() -> Iterator[bytes]:
            with open(path, "rb") as f:
                yield from iter(lambda: f.read(chunk_size), b"")

        return from_path
    start = source.tell() if source.seekable() else None
    f = source

    def from_file() -> Iterator[bytes]:
        if start is not None:
            f.seek(start)
        yield from iter(lambda: f.read(chunk_size), b"")

    return from_file


def write_sink(dest: Sink, chunks: Iterable[bytes]) -> int:
    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "wb") as f:
            return write_sink(f, chunks)
    n = 0
    for c in chunks:
        dest.write(c)
        n += len(c)
    return n


def async_chunks_of(source: Source, chunk_size: int = CHUNK) -> Callable[[], AsyncIterator[bytes]]:
    """`chunks_of` for the async client (local reads are short and block)."""
    make = chunks_of(source, chunk_size)

    async def gen() -> AsyncIterator[bytes]:
        for c in make():
            yield c

    return gen


async def async_write_sink(dest: Sink, chunks: AsyncIterator[bytes]) -> int:
    if isinstance(dest, (str, os.PathLike)):
        with open(dest, "wb") as f:
            return await async_write_sink(f, chunks)
    n = 0
    async for c in chunks:
        dest.write(c)
        n += len(c)
    return n
