//! An RBD image's persistent reservations, shared by its gateways through the image.

use scsi::PrPersistence;
use std::io;
use std::sync::Arc;

/// An RBD image's persistent reservations, kept in the image's metadata (through the observer
/// connection, which a fenced gateway keeps): every gateway reads them before each PERSISTENT
/// RESERVE command and the owner follows them once a second, so the registrations an initiator
/// made through one gateway hold on all of them and survive a takeover. APTPL is kept too.
pub struct ImageReservations {
    observer: Arc<rbd::Image>,
    medium: String,
    device: String,
    /// The stored text the last PERSISTENT RESERVE command loaded ("" when none): its save
    /// replaces exactly that, or is refused. (The core loads and saves under the LU's
    /// reservation lock, so this is the command's own load.)
    loaded: std::sync::Mutex<Option<String>>,
}

/// The image metadata key holding the reservations (the TOML of a reservation file).
pub const RESERVATIONS_KEY: &str = "ferrosan.persistent_reservations";

impl ImageReservations {
    pub fn new(observer: Arc<rbd::Image>, device: &str) -> Arc<ImageReservations> {
        Arc::new(ImageReservations {
            medium: format!("rbd:{}", observer.name()),
            observer,
            device: device.to_string(),
            loaded: std::sync::Mutex::new(None),
        })
    }

    fn stored_text(&self) -> io::Result<Option<String>> {
        self.observer
            .metadata(RESERVATIONS_KEY)
            .map_err(store::rbd::io_error)
    }

    fn parse(&self, text: &str) -> io::Result<scsi::PersistentReservations> {
        crate::topology::state::reservations_from_text(text, &self.medium).map_err(|e| {
            tracing::error!(device = %self.device, "persistent reservations in the image: {e}");
            io::Error::new(io::ErrorKind::InvalidData, e)
        })
    }
}

impl PrPersistence for ImageReservations {
    /// Saves over the text the command loaded, atomically: another gateway's save in between
    /// (two PERSISTENT RESERVE OUTs through two gateways at once) makes this one
    /// [`scsi::SaveRefused::Conflict`], and the core runs the command again on the new state.
    fn save(&self, state: &scsi::PersistentReservations) -> io::Result<()> {
        let text = crate::topology::state::reservations_to_text(state, &self.medium)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let Some(expected) = loaded.take() else {
            // Nothing loaded first (the core always loads a shared state): load, run again.
            return Err(scsi::SaveRefused::Conflict.error());
        };
        match self
            .observer
            .compare_and_set_metadata(RESERVATIONS_KEY, &expected, &text)
        {
            Ok(true) => {
                *loaded = Some(text);
                Ok(())
            }
            Ok(false) => {
                tracing::info!(device = %self.device, "persistent reservations changed through another gateway meanwhile: the PERSISTENT RESERVE OUT runs again");
                Err(scsi::SaveRefused::Conflict.error())
            }
            Err(e) => {
                tracing::error!(device = %self.device, "cannot save persistent reservations in the image: {e}; the PERSISTENT RESERVE OUT fails");
                Err(store::rbd::io_error(e))
            }
        }
    }

    fn shared(&self) -> bool {
        true
    }

    fn load(&self) -> io::Result<Option<scsi::PersistentReservations>> {
        let text = self.stored_text();
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        *loaded = None;
        let Some(text) = text? else {
            *loaded = Some(String::new());
            return Ok(None);
        };
        let state = self.parse(&text)?;
        *loaded = Some(text);
        Ok(Some(state))
    }
}
