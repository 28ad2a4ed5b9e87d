//! A topology as the unit tests of this room and those above it build it.

use std::sync::Arc;

use super::{DeviceContext, Topology};
use crate::config::Config;
use crate::metrics::Metrics;

/// What a start builds for `config` (TOML): its devices opened (one worker, no gateways).
pub(crate) struct Opened {
    pub config: Config,
    pub topology: Topology,
    pub context: DeviceContext,
    pub metrics: Arc<Metrics>,
}

pub(crate) fn opened(config: &str) -> Opened {
    let config = Config::from_toml_str(config, "test").expect("a valid config");
    let metrics = Arc::new(Metrics::new());
    let context = DeviceContext::new(&config, Arc::clone(&metrics));
    let devices = (config.devices.iter())
        .map(|d| {
            (
                d.name.as_str().into(),
                context.open(d, &config).expect("it opens"),
            )
        })
        .collect();
    let topology = Topology::assemble(config.clone(), devices, 1).expect("built");
    Opened {
        config,
        topology,
        context,
        metrics,
    }
}
