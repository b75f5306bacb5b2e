"""What every part of a client shares: ``operation``, a client method written once, and
``Core``, the plumbing each part is built with (see the package's docstring for the layout)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Self, TypeVar, overload

from mtask.clock import Clock
from mtask.driver import Op
from mtask.store.retention import DefaultsCache

if TYPE_CHECKING:
    from mtask.client import AsyncTaskClient, TaskClient
    from mtask.registry import Registry
    from mtask.security.encryption import Encryption

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(eq=False)
class Core:
    """One client's plumbing, given to each of its parts at construction: where its tasks are,
    the server's clock and what completes and seals a publish. The client's attributes of these
    names read it."""

    database_name: str
    collection_name: str
    max_params_bytes: int
    clock: Clock
    registry: Registry | None
    """Handlers whose declared option defaults complete this client's publishes."""
    encryption: Encryption | None
    """Encrypts the params of the publishes that ask (``mtask.security.encryption``) and decrypts
    what ``get`` reads (None: encrypted tasks read as they are stored)."""
    mongo: Any
    """The client's ``MongoClient``: a ``session=`` must be one it started."""
    retention_cache: DefaultsCache = dataclasses.field(default_factory=DefaultsCache)
    """The retention defaults, read at most every ``retention.CACHE_SECONDS``: publishing reads
    them, setting one clears them."""


class operation(Generic[P, R]):
    """A client method written once, as an operation (an ``Op``: the ``Call``s it makes, see
    ``mtask.driver``), in the part of the client it belongs to. On a ``TaskClient`` it runs and
    returns its value; on an ``AsyncTaskClient`` it returns a coroutine of it (each client's
    ``_bind`` says which). A ``session=`` keyword, where the method takes one, also goes to the
    driver: every write joins the caller's session."""

    def __init__(self, build: Callable[Concatenate[Any, P], Op[R]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__
        self.__name__ = build.__name__
        self.part: type[Any] | None = None
        """The class it is written in: a client runs it on its instance of that part."""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        if self.part is None:  # not the clients' table (``api.Operations``), which names it again
            self.part = owner

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, client: TaskClient, owner: type[Any] | None = None) -> Callable[P, R]: ...

    @overload
    def __get__(
        self, client: AsyncTaskClient, owner: type[Any] | None = None
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __get__(self, client: Any, owner: Any = None) -> Any:
        if client is None:
            return self
        return client._bind(self.build, self.part)
