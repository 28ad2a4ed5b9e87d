//! The daemon's state as the unit tests of the rooms above it build it.

use std::sync::Arc;

/// The daemon's state for `config` (TOML), its devices opened, as a start builds it (one
/// worker, no gateways).
pub(crate) fn shared(config: &str) -> crate::shared::Shared {
    let opened = crate::topology::testing::opened(config);
    let doors = crate::admission::doors::Doors::new(
        &opened.config.limits,
        Default::default(),
        Arc::clone(&opened.metrics),
    );
    crate::shared::Shared::new(
        &opened.config,
        opened.topology,
        opened.context,
        opened.metrics,
        Vec::new(),
        Arc::new(doors),
        1,
    )
}
