//! Where a command runs: one pure decision per command, from facts the SCSI core states about
//! the command (`scsi::runs_long`, `scsi::plans`, `LogicalUnit::waits_for_device`, ...) and
//! facts the topology states about its LU (its disk, its store, its owner). The connection
//! gathers the facts once, when the command is complete in the target, and carries out the
//! answer: inline on the worker, or handed to the one place it names. A path that cannot take
//! the command at that moment (a reset draining the LU, no buffer, the store declining to
//! plan it) hands it to the I/O threads, never to another path.

/// What decides a command's way, each fact a cheap lookup the connection makes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// No LU bounds the command's cost (EXTENDED COPY, WRITE SAME, UNMAP: `scsi::runs_long`).
    pub runs_long: bool,
    /// This gateway does not own the LU and ships this command to its owner
    /// (`LogicalUnit::ships_to_owner`).
    pub ships: bool,
    /// The LU is on a real device (not RAM, not tmpfs); `None` otherwise.
    pub disk: Option<Disk>,
}

/// Facts about a command on an LU on a real device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Disk {
    /// Its reads and writes always wait for the device: direct I/O, or a store that completes
    /// I/O itself.
    pub direct: bool,
    /// This connection's io_uring takes the LU's I/O.
    pub ring: bool,
    /// The store completes I/O itself, with callbacks (librbd).
    pub asynchronous: bool,
    /// The command is one the core plans as block I/O (READ, WRITE, SYNCHRONIZE CACHE).
    pub plans: bool,
    /// A write the store's cache absorbs (write-back, no FUA).
    pub buffered_write: bool,
    /// The device's buffered writes have been stalling: they run off the worker for now.
    pub offloading: bool,
    /// The command waits for the device to make data durable (write-through, FUA, flushes,
    /// ...: `LogicalUnit::waits_for_device`).
    pub waits_for_device: bool,
}

/// Where a command runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// On the network worker, now.
    Inline,
    /// On the worker, timed for the kernel making it wait (a buffered write on a disk).
    InlineWatched,
    /// To the connection's io_uring.
    Ring,
    /// To the store, which completes it on a thread of its own.
    Async,
    /// To the LU's owner, through another gateway.
    Owner,
    /// To the I/O threads.
    Blocking,
    /// To the I/O threads because the device's buffered writes stall (counted).
    Offload,
}

impl Route {
    /// Whether the command runs on the worker.
    pub fn inline(self) -> bool {
        matches!(self, Route::Inline | Route::InlineWatched)
    }
}

/// The one route decision.
pub fn route(f: &Facts) -> Route {
    // Shipped commands wait for the network; commands of unbounded cost would hold every
    // session of the worker (a copy may write another LU's disk).
    if f.ships {
        return Route::Owner;
    }
    if f.runs_long {
        return Route::Blocking;
    }
    let Some(d) = f.disk else {
        // RAM and tmpfs: nothing to wait for.
        return Route::Inline;
    };
    if d.direct && d.plans {
        return if d.ring {
            Route::Ring
        } else if d.asynchronous {
            Route::Async
        } else {
            Route::Blocking
        };
    }
    if d.buffered_write {
        return if d.offloading {
            Route::Offload
        } else {
            Route::InlineWatched
        };
    }
    if d.waits_for_device {
        Route::Blocking
    } else {
        Route::Inline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIRECT_READ: Disk = Disk {
        direct: true,
        ring: true,
        asynchronous: false,
        plans: true,
        buffered_write: false,
        offloading: false,
        waits_for_device: false,
    };

    fn on(disk: Disk) -> Facts {
        Facts {
            disk: Some(disk),
            ..Facts::default()
        }
    }

    #[test]
    fn every_way_a_command_can_go() {
        let page = Disk {
            direct: false,
            ring: false,
            plans: true,
            ..DIRECT_READ
        };
        let rbd = Disk {
            ring: false,
            asynchronous: true,
            ..DIRECT_READ
        };
        let table: [(&str, Facts, Route); 14] = [
            ("RAM", Facts::default(), Route::Inline),
            (
                "RAM copy",
                Facts {
                    runs_long: true,
                    ..Facts::default()
                },
                Route::Blocking,
            ),
            (
                "shipped",
                Facts {
                    ships: true,
                    ..on(rbd)
                },
                Route::Owner,
            ),
            (
                "shipped copy",
                Facts {
                    ships: true,
                    runs_long: true,
                    ..on(rbd)
                },
                Route::Owner,
            ),
            ("direct read, ring", on(DIRECT_READ), Route::Ring),
            (
                "direct read, no ring",
                on(Disk {
                    ring: false,
                    ..DIRECT_READ
                }),
                Route::Blocking,
            ),
            ("RBD read", on(rbd), Route::Async),
            (
                "RBD UNMAP",
                on(Disk {
                    plans: false,
                    waits_for_device: true,
                    ..rbd
                }),
                Route::Blocking,
            ),
            (
                "direct MODE SENSE",
                on(Disk {
                    plans: false,
                    ..DIRECT_READ
                }),
                Route::Inline,
            ),
            ("cached read", on(page), Route::Inline),
            (
                "buffered write",
                on(Disk {
                    buffered_write: true,
                    ..page
                }),
                Route::InlineWatched,
            ),
            (
                "buffered write, stalling",
                on(Disk {
                    buffered_write: true,
                    offloading: true,
                    ..page
                }),
                Route::Offload,
            ),
            (
                "write-through write",
                on(Disk {
                    waits_for_device: true,
                    ..page
                }),
                Route::Blocking,
            ),
            (
                "disk copy",
                Facts {
                    runs_long: true,
                    ..on(page)
                },
                Route::Blocking,
            ),
        ];
        for (what, facts, want) in table {
            assert_eq!(route(&facts), want, "{what}: {facts:?}");
            assert_eq!(
                want.inline(),
                matches!(want, Route::Inline | Route::InlineWatched)
            );
        }
    }
}
