//! The daemon's state as the unit tests of the rooms above it build it.

/// The daemon's state for `config` (TOML), its devices opened, as a start builds it (one
/// worker, no gateways).
pub(crate) fn shared(config: &str) -> crate::shared::Shared {
    use std::sync::Arc;
    let config = crate::config::Config::from_toml_str(config, "test").expect("a valid config");
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let context = crate::topology::DeviceContext::new(&config, Arc::clone(&metrics));
    let devices = (config.devices.iter())
        .map(|d| {
            (
                d.name.as_str().into(),
                context.open(d, &config).expect("it opens"),
            )
        })
        .collect();
    let topology = crate::topology::Topology::assemble(config.clone(), devices, 1).expect("built");
    let doors = crate::admission::doors::Doors::new(
        &config.limits,
        Default::default(),
        Arc::clone(&metrics),
    );
    crate::shared::Shared::new(
        &config,
        topology,
        context,
        metrics,
        Vec::new(),
        Arc::new(doors),
        1,
    )
}
