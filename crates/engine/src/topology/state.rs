//! State that must survive a restart: persistent reservations of LUs whose initiators asked
//! for it (APTPL). One small TOML file per device under `<state_dir>/reservations/`, replaced
//! atomically (written to a temporary file, fsynced, renamed, directory fsynced) before the
//! PERSISTENT RESERVE OUT that changed it completes, as SCST does.
//!
//! What is deliberately not kept (docs/CONFIG.md, *State directory*): RAM LUs' reservations
//! (their medium does not survive either), unit attentions, SPC-2 reservations (released by
//! any reset or nexus loss anyway). ALUA states are the config's, not chosen at runtime.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use scsi::{PersistentReservations, PrNexus, PrNotice, PrPersistence, PrRegistration};
use serde::{Deserialize, Serialize};

/// Bytes a saved reservation state (a file, or an RBD image's metadata) may have, at most.
/// Saving never writes more ([`to_text`]), so what was saved always loads.
/// [`scsi::REGISTRATIONS_MAX`] registrations of the longest names take ~90 KiB.
pub const STATE_BYTES_MAX: usize = 1 << 20;
/// Why a saved reservation state does not load. The device it belongs to is fenced until the
/// operator repairs or removes it (`topology::DeviceContext::open`).
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("larger than {STATE_BYTES_MAX} bytes")]
    TooLarge,
    #[error("{0}")]
    NotToml(#[from] toml::de::Error),
    #[error("saved for {saved}, not {medium}")]
    WrongMedium { saved: String, medium: String },
    /// Well-formed TOML that no save writes (a key, a holder, a type, notices out of order).
    #[error("{0}")]
    Damaged(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// One of the above, in the file at `path`.
    #[error("{}: {error}", path.display())]
    In {
        path: PathBuf,
        error: Box<StateError>,
    },
}

/// The header line of a reservation file.
const FILE_HEADER: &str = "# ferrosan: persistent reservations (APTPL). Written by the daemon.\n";

/// The state directory to use: the configured one, else `/var/lib/ferrosan` for root and
/// `$XDG_STATE_HOME/ferrosan` (or `~/.local/state/ferrosan`) for anyone else.
pub fn state_dir(configured: Option<&Path>) -> Option<PathBuf> {
    if let Some(dir) = configured {
        return Some(dir.to_path_buf());
    }
    if rustix::process::geteuid().is_root() {
        return Some(PathBuf::from("/var/lib/ferrosan"));
    }
    if let Some(dir) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir).join("ferrosan"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|home| PathBuf::from(home).join(".local/state/ferrosan"))
}

/// Where device `name` backed by `medium` keeps its reservations: the name for people, a
/// checksum of the medium's path so that two media never share a file.
pub fn reservation_file(state_dir: &Path, name: &str, medium: &Path) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    let sum = crc32c::crc32c(medium.as_os_str().as_encoded_bytes());
    state_dir
        .join("reservations")
        .join(format!("{safe}-{sum:08x}.toml"))
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct SavedFile {
    /// The medium this state belongs to (checked at load).
    medium: String,
    aptpl: bool,
    generation: u32,
    #[serde(default)]
    registration: Vec<SavedRegistration>,
    reservation: Option<SavedReservation>,
    /// The unit attentions of the last changes (a state shared by RBD gateways only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    notice: Vec<SavedNotice>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct SavedNotice {
    seq: u64,
    asc: u8,
    ascq: u8,
    #[serde(default)]
    nexus: Vec<SavedNexus>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct SavedNexus {
    initiator_port: String,
    relative_port: u16,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct SavedRegistration {
    initiator_port: String,
    relative_port: u16,
    /// Hex: TOML integers are signed 64-bit, keys are unsigned.
    key: String,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
struct SavedReservation {
    initiator_port: String,
    relative_port: u16,
    #[serde(rename = "type")]
    pr_type: u8,
}

/// Reservations of one device, saved to one file.
pub struct ReservationFile {
    path: PathBuf,
    medium: PathBuf,
    device: String,
}

impl ReservationFile {
    /// Saves to `path`; its directory is made (owner-only) at the first save, so a daemon
    /// whose initiators never ask for APTPL leaves nothing on disk.
    pub fn new(path: PathBuf, medium: &Path, device: &str) -> ReservationFile {
        ReservationFile {
            path,
            medium: medium.to_path_buf(),
            device: device.to_string(),
        }
    }

    /// The saved state, if there is one for this medium. A file that cannot be read or parsed
    /// is an error: starting without reservations an initiator made durable could let a fenced
    /// host write.
    pub fn load(&self) -> Result<Option<PersistentReservations>, StateError> {
        let io = |source| StateError::Io {
            path: self.path.clone(),
            source,
        };
        let located = |error| StateError::In {
            path: self.path.clone(),
            error: Box::new(error),
        };
        let meta = match fs::metadata(&self.path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        };
        if meta.len() > (STATE_BYTES_MAX + FILE_HEADER.len()) as u64 {
            return Err(located(StateError::TooLarge));
        }
        let text = fs::read_to_string(&self.path).map_err(io)?;
        let saved: SavedFile = toml::from_str(&text).map_err(|e| located(e.into()))?;
        if Path::new(&saved.medium) != self.medium {
            return Err(located(StateError::WrongMedium {
                saved: saved.medium,
                medium: self.medium.display().to_string(),
            }));
        }
        decode(saved).map(Some).map_err(located)
    }

    fn write(&self, state: &PersistentReservations) -> std::io::Result<()> {
        let text = to_text(state, &self.medium)?;
        if let Some(dir) = self.path.parent() {
            create_private_dir(dir)?;
        }
        let tmp = self.path.with_extension("toml.tmp");
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(FILE_HEADER.as_bytes())?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
        }
        fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }
}

impl PrPersistence for ReservationFile {
    fn save(&self, state: &PersistentReservations) -> std::io::Result<()> {
        let result = self.write(state);
        if let Err(e) = &result {
            tracing::error!(
                device = %self.device,
                "cannot save persistent reservations to {}: {e}; the PERSISTENT RESERVE OUT fails",
                self.path.display()
            );
        }
        result
    }
}

/// The saved form of `state` for `medium` (TOML), for stores other than a file (an RBD
/// image's metadata).
pub fn reservations_to_text(
    state: &PersistentReservations,
    medium: &str,
) -> std::io::Result<String> {
    to_text(state, Path::new(medium))
}

/// The saved form of `state`, at most [`STATE_BYTES_MAX`] bytes. Past it, the oldest notices
/// go first (a gateway that had not seen them misses their unit attentions, which initiators
/// recover from with READ KEYS); a state still too large is refused with
/// [`scsi::SaveRefused::TooLarge`], and its PERSISTENT RESERVE OUT fails with nothing changed.
fn to_text(state: &PersistentReservations, medium: &Path) -> std::io::Result<String> {
    let mut saved = encode(state, medium);
    loop {
        let text = toml::to_string(&saved).map_err(|e| std::io::Error::other(e.to_string()))?;
        if text.len() <= STATE_BYTES_MAX {
            return Ok(text);
        }
        if saved.notice.is_empty() {
            return Err(scsi::SaveRefused::TooLarge.error());
        }
        saved.notice.remove(0);
    }
}

/// Reads back [`reservations_to_text`], checking it was saved for `medium`.
pub fn reservations_from_text(
    text: &str,
    medium: &str,
) -> Result<PersistentReservations, StateError> {
    if text.len() > STATE_BYTES_MAX {
        return Err(StateError::TooLarge);
    }
    let saved: SavedFile = toml::from_str(text)?;
    if saved.medium != medium {
        return Err(StateError::WrongMedium {
            saved: saved.medium,
            medium: medium.to_string(),
        });
    }
    decode(saved)
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

fn encode(state: &PersistentReservations, medium: &Path) -> SavedFile {
    SavedFile {
        medium: medium.display().to_string(),
        aptpl: state.aptpl,
        generation: state.generation,
        registration: state
            .registrations
            .iter()
            .map(|r| SavedRegistration {
                initiator_port: r.nexus.initiator_port.clone(),
                relative_port: r.nexus.relative_port,
                key: format!("{:#018x}", r.key),
            })
            .collect(),
        reservation: state
            .reservation
            .as_ref()
            .map(|(holder, pr_type)| SavedReservation {
                initiator_port: holder.initiator_port.clone(),
                relative_port: holder.relative_port,
                pr_type: *pr_type,
            }),
        notice: state
            .notices
            .iter()
            .map(|n| SavedNotice {
                seq: n.seq,
                asc: n.ua.0,
                ascq: n.ua.1,
                nexus: n
                    .nexuses
                    .iter()
                    .map(|x| SavedNexus {
                        initiator_port: x.initiator_port.clone(),
                        relative_port: x.relative_port,
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn decode(saved: SavedFile) -> Result<PersistentReservations, StateError> {
    let mut registrations = Vec::with_capacity(saved.registration.len());
    for r in saved.registration {
        let digits = r.key.strip_prefix("0x").unwrap_or(&r.key);
        let key = u64::from_str_radix(digits, 16)
            .map_err(|e| StateError::Damaged(format!("registration key {:?}: {e}", r.key)))?;
        registrations.push(PrRegistration {
            nexus: PrNexus {
                initiator_port: r.initiator_port,
                relative_port: r.relative_port,
            },
            key,
        });
    }
    let reservation = match saved.reservation {
        None => None,
        Some(r) => Some(decode_reservation(r, &registrations)?),
    };
    if saved.notice.len() > scsi::NOTICES_KEPT
        || saved.notice.windows(2).any(|w| w[0].seq >= w[1].seq)
    {
        return Err(StateError::Damaged(format!(
            "notices: at most {} in rising order expected",
            scsi::NOTICES_KEPT
        )));
    }
    let notices = saved
        .notice
        .into_iter()
        .map(|n| PrNotice {
            seq: n.seq,
            ua: (n.asc, n.ascq),
            nexuses: n
                .nexus
                .into_iter()
                .map(|x| PrNexus {
                    initiator_port: x.initiator_port,
                    relative_port: x.relative_port,
                })
                .collect(),
        })
        .collect();
    Ok(PersistentReservations {
        aptpl: saved.aptpl,
        generation: saved.generation,
        registrations,
        reservation,
        notices,
    })
}

/// A saved reservation: a valid type, held by a registered nexus. An all-registrants
/// reservation (types 7, 8) is held by every registrant and outlives the registration of the
/// nexus that made it, which stays its recorded holder; any other type's holder is registered.
fn decode_reservation(
    r: SavedReservation,
    registrations: &[PrRegistration],
) -> Result<(PrNexus, u8), StateError> {
    let holder = PrNexus {
        initiator_port: r.initiator_port,
        relative_port: r.relative_port,
    };
    let held = if matches!(r.pr_type, 7 | 8) {
        !registrations.is_empty()
    } else {
        registrations.iter().any(|reg| reg.nexus == holder)
    };
    if !held {
        return Err(StateError::Damaged(
            "the reservation's holder is not registered".into(),
        ));
    }
    if !matches!(r.pr_type, 1 | 3 | 5..=8) {
        let why = format!("reservation type {} is not valid", r.pr_type);
        return Err(StateError::Damaged(why));
    }
    Ok((holder, r.pr_type))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PersistentReservations {
        let a = PrNexus {
            initiator_port: "iqn.2026-11.org.example:a,i,0x23d000000001".into(),
            relative_port: 1,
        };
        PersistentReservations {
            aptpl: true,
            generation: 7,
            registrations: vec![
                PrRegistration {
                    nexus: a.clone(),
                    key: u64::MAX,
                },
                PrRegistration {
                    nexus: PrNexus {
                        initiator_port: "iqn.2026-11.org.example:b,i,0x23d000000002".into(),
                        relative_port: 2,
                    },
                    key: 0xAB,
                },
            ],
            reservation: Some((a.clone(), 3)),
            notices: vec![PrNotice {
                seq: 4,
                ua: (0x2A, 0x05),
                nexuses: vec![a],
            }],
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrosan-state-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn saved_state_loads_back_whole() {
        let dir = temp_dir("roundtrip");
        let medium = Path::new("/srv/lun0.img");
        let path = reservation_file(&dir, "lun 0", medium);
        assert!(path.to_string_lossy().contains("reservations/lun_0-"));
        let file = ReservationFile::new(path.clone(), medium, "lun 0");
        assert_eq!(file.load().unwrap(), None, "nothing saved yet");
        file.save(&sample()).unwrap();
        assert_eq!(file.load().unwrap(), Some(sample()));
        // Replaced whole on the next save; no temporary file left behind.
        let mut next = sample();
        next.registrations.pop();
        next.generation = 8;
        file.save(&next).unwrap();
        assert_eq!(file.load().unwrap(), Some(next));
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let _ = fs::remove_dir_all(&dir);
    }

    /// An all-registrants reservation outlives its maker's registration (the recorded holder
    /// then names an unregistered nexus): it saves and loads; any other type's must not.
    #[test]
    fn all_registrants_reservations_outlive_their_makers_registration() {
        let mut state = sample();
        let gone = PrNexus {
            initiator_port: "iqn.1994-05.com.example:gone,i,0x000000000001".into(),
            relative_port: 1,
        };
        for pr_type in [7u8, 8] {
            state.reservation = Some((gone.clone(), pr_type));
            let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
            assert_eq!(reservations_from_text(&text, "rbd:rbd/vm").unwrap(), state);
        }
        state.reservation = Some((gone, 1));
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        let e = reservations_from_text(&text, "rbd:rbd/vm").unwrap_err();
        assert!(e.to_string().contains("not registered"), "{e}");
        // Text saved for another medium is refused.
        state.reservation = None;
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        assert!(reservations_from_text(&text, "rbd:rbd/other").is_err());
    }

    /// A state shared by gateways keeps its last notices, numbered in rising order; more, or
    /// out of order, is refused (nothing else writes them).
    #[test]
    fn notices_load_back_in_order_and_bounded() {
        let mut state = sample();
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        assert!(text.contains("[[notice]]"), "{text}");
        assert_eq!(reservations_from_text(&text, "rbd:rbd/vm").unwrap(), state);
        // A state without notices saves none (files of single targets look as before).
        state.notices.clear();
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        assert!(!text.contains("notice"), "{text}");
        assert_eq!(reservations_from_text(&text, "rbd:rbd/vm").unwrap(), state);
        let notice = |seq| PrNotice {
            seq,
            ua: (0x2A, 0x03),
            nexuses: Vec::new(),
        };
        state.notices = vec![notice(2), notice(2)];
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        assert!(reservations_from_text(&text, "rbd:rbd/vm").is_err());
        state.notices = (1..=scsi::NOTICES_KEPT as u64 + 1).map(notice).collect();
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        assert!(reservations_from_text(&text, "rbd:rbd/vm").is_err());
        state.notices.remove(0);
        let text = reservations_to_text(&state, "rbd:rbd/vm").unwrap();
        assert_eq!(reservations_from_text(&text, "rbd:rbd/vm").unwrap(), state);
    }

    #[test]
    fn two_media_never_share_a_file() {
        let dir = Path::new("/state");
        assert_ne!(
            reservation_file(dir, "d", Path::new("/a.img")),
            reservation_file(dir, "d", Path::new("/b.img"))
        );
    }

    #[test]
    fn damaged_or_foreign_files_are_errors_naming_the_file() {
        let dir = temp_dir("damaged");
        let medium = Path::new("/srv/lun1.img");
        let path = reservation_file(&dir, "d1", medium);
        let file = ReservationFile::new(path.clone(), medium, "d1");
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        for (text, why) in [
            ("aptpl = true\n", "missing field"),
            ("this is not toml", "expected"),
            (
                "medium = \"/srv/other.img\"\naptpl = true\ngeneration = 1\n",
                "saved for /srv/other.img",
            ),
            (
                "medium = \"/srv/lun1.img\"\naptpl = true\ngeneration = 1\n[[registration]]\ninitiator_port = \"x\"\nrelative_port = 1\nkey = \"zz\"\n",
                "registration key",
            ),
            (
                "medium = \"/srv/lun1.img\"\naptpl = true\ngeneration = 1\n[reservation]\ninitiator_port = \"x\"\nrelative_port = 1\ntype = 1\n",
                "not registered",
            ),
        ] {
            fs::write(&path, text).unwrap();
            let err = file.load().unwrap_err().to_string();
            assert!(err.contains(&*path.to_string_lossy()), "{err}");
            assert!(err.contains(why), "{why}: {err}");
        }
        fs::write(&path, vec![b'#'; STATE_BYTES_MAX + FILE_HEADER.len() + 1]).unwrap();
        assert!(file.load().unwrap_err().to_string().contains("larger than"));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_save_is_an_error() {
        let dir = temp_dir("readonly");
        let medium = Path::new("/srv/lun2.img");
        let path = reservation_file(&dir, "d2", medium);
        let file = ReservationFile::new(path.clone(), medium, "d2");
        // A directory where the file should be: rename fails.
        fs::create_dir_all(&path).unwrap();
        fs::write(path.join("x"), b"x").unwrap();
        assert!(file.save(&sample()).is_err());
        let _ = fs::remove_dir_all(&dir);
    }

    /// A state with `registrations` registrations of the longest initiator port names and
    /// `notices` notices naming each of them.
    fn big(registrations: usize, notices: u64) -> PersistentReservations {
        let nexus = |n: usize| PrNexus {
            initiator_port: format!("iqn.2026-11.test:{:0>200},i,0x80123456{n:04x}", n),
            relative_port: 1,
        };
        PersistentReservations {
            aptpl: true,
            generation: 1,
            registrations: (0..registrations)
                .map(|n| PrRegistration {
                    nexus: nexus(n),
                    key: n as u64 + 1,
                })
                .collect(),
            reservation: None,
            notices: (1..=notices)
                .map(|seq| PrNotice {
                    seq,
                    ua: (0x2A, 0x04),
                    nexuses: (0..registrations).map(nexus).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_saved_state_is_never_larger_than_a_load_accepts() {
        let medium = Path::new("/srv/lun3.img");
        // The most registrations with the longest names fit, with room to spare.
        let most = big(scsi::REGISTRATIONS_MAX, 0);
        let text = to_text(&most, medium).unwrap();
        assert!(text.len() < STATE_BYTES_MAX / 4, "{} bytes", text.len());
        assert_eq!(
            reservations_from_text(&text, "/srv/lun3.img").unwrap(),
            most
        );
        // Sixteen notices naming all of them would not: the oldest are left out.
        let noisy = big(scsi::REGISTRATIONS_MAX, scsi::NOTICES_KEPT as u64);
        let text = to_text(&noisy, medium).unwrap();
        assert!(text.len() <= STATE_BYTES_MAX);
        let back = reservations_from_text(&text, "/srv/lun3.img").unwrap();
        assert_eq!(back.registrations, noisy.registrations);
        assert!(!back.notices.is_empty() && back.notices.len() < noisy.notices.len());
        assert_eq!(
            back.notices.last(),
            noisy.notices.last(),
            "the newest are kept"
        );
        // Registrations alone past the bound: refused, nothing written.
        let e = to_text(&big(scsi::REGISTRATIONS_MAX * 16, 0), medium).unwrap_err();
        assert_eq!(
            scsi::SaveRefused::of(&e),
            Some(scsi::SaveRefused::TooLarge),
            "{e}"
        );
        let too_long = "#".repeat(STATE_BYTES_MAX + 1);
        assert!(reservations_from_text(&too_long, "/srv/lun3.img").is_err());
    }
}
