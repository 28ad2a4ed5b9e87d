//! The owners' heartbeats, one object per gateway and pool. Every [`BEAT_INTERVAL`] a gateway
//! writes one object into each pool it serves images of: a count, and for every image of that
//! pool it owns, the lock holder it owns it as (its data connection, as librbd names it). A
//! non-owner reads its peers' objects at most once per [`PEER_FRESH`] for all its images of
//! the pool. So an idle pool costs the cluster one write a second per gateway and one read
//! per peer, however many images it holds; a heartbeat per image cost one write and one read
//! each.
//!
//! What the count proves is that the owner's process runs and reaches the cluster. An entry
//! names the holder, so a beat never vouches for a lock it lost: a non-owner compares it with
//! the lock holder the cluster reports (`policy::OwnerVigil`). The objects are written through
//! the observer connection, which holds no lock and so is never fenced.

use super::policy::BEAT_INTERVAL;
use super::ImageOwnership;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Gateway `NAME`'s heartbeat object in a pool is `ferrosan.gateway_beat.NAME`.
pub const BEAT_OBJECT_PREFIX: &str = "ferrosan.gateway_beat.";

/// The object's first line: its format.
const FORMAT_LINE: &str = "ferrosan gateway heartbeat 1";

/// How long a peer's object, once read, answers the looks of every image of its pool.
const PEER_FRESH: Duration = Duration::from_millis(500);

/// The most of a peer's object read (an entry is ~100 bytes: ~10,000 images).
const OBJECT_BYTES_MAX: usize = 1 << 20;

/// (ceph.conf, client, pool, this gateway): one heartbeat per pool of a cluster.
type Key = (Option<PathBuf>, Option<String>, String, String);

/// What a peer's object said when it was read.
struct PeerBeat {
    read_at: Instant,
    /// None: the peer writes no such object (a gateway of an earlier release).
    beat: Option<Parsed>,
}

#[derive(Debug, PartialEq, Eq)]
struct Parsed {
    count: String,
    /// Image name to lock holder.
    holders: HashMap<String, String>,
}

/// What a peer's heartbeat says of one image.
#[derive(Debug, PartialEq, Eq)]
pub enum PeerSays {
    /// The peer vouches for `holder` of the image: the heartbeat value `HOLDER COUNT`.
    Beat(String),
    /// The peer writes heartbeats but vouches for no holder of this image.
    Silent,
    /// The peer writes no heartbeat object.
    Nothing,
}

/// One gateway's heartbeat in one pool, shared by every image of the pool it serves.
pub struct PoolBeat {
    pool: rbd::Pool,
    object: String,
    /// The images of the pool this gateway serves (those gone are dropped as found).
    members: Mutex<Vec<Weak<ImageOwnership>>>,
    count: AtomicU64,
    /// One write at a time (a later count never lands before an earlier one); holds whether
    /// the last one written vouched for nothing.
    writing: Mutex<bool>,
    failing: AtomicBool,
    /// Each peer's object as last read, by gateway name.
    peers: Mutex<HashMap<String, Arc<Mutex<Option<PeerBeat>>>>>,
}

impl PoolBeat {
    /// The heartbeat of gateway `me` in `store`'s pool: the one already running for that
    /// pool, or a new one with its thread.
    pub fn of(store: &store::RbdStore, me: &str) -> std::io::Result<Arc<PoolBeat>> {
        static BEATS: Mutex<Option<HashMap<Key, Weak<PoolBeat>>>> = Mutex::new(None);
        let spec = store.spec();
        let key = (
            spec.conf.clone(),
            spec.client.clone(),
            spec.pool.clone(),
            me.to_string(),
        );
        let mut beats = BEATS.lock().unwrap_or_else(|p| p.into_inner());
        let map = beats.get_or_insert_with(HashMap::new);
        if let Some(beat) = map.get(&key).and_then(Weak::upgrade) {
            return Ok(beat);
        }
        let beat = Arc::new(PoolBeat {
            pool: store.observer_pool()?,
            object: format!("{BEAT_OBJECT_PREFIX}{me}"),
            members: Mutex::new(Vec::new()),
            count: AtomicU64::new(0),
            writing: Mutex::new(false),
            failing: AtomicBool::new(false),
            peers: Mutex::new(HashMap::new()),
        });
        let weak = Arc::downgrade(&beat);
        std::thread::Builder::new()
            .name("ferrosan-beat".into())
            .spawn(move || beat_while_used(weak))?;
        map.retain(|_, weak| weak.strong_count() > 0);
        map.insert(key, Arc::downgrade(&beat));
        Ok(beat)
    }

    /// Counts `image` among the images this heartbeat speaks for (while it owns them).
    pub fn join(&self, image: &Arc<ImageOwnership>) {
        let mut members = self.members.lock().unwrap_or_else(|p| p.into_inner());
        members.retain(|m| m.strong_count() > 0);
        members.push(Arc::downgrade(image));
    }

    /// Writes the heartbeat now: the next count, with an entry for every member that owns its
    /// image. A gateway that owns none of the pool's images writes once that it vouches for
    /// nothing, then nothing until it owns one: nobody judges it. A gateway that just took an image calls it at once, so that an owner dying before
    /// its next beat is still judged by its beat, not by the cluster's watch alone (30 s).
    pub fn publish(&self) -> Result<(), rbd::Error> {
        let members: Vec<Arc<ImageOwnership>> = {
            let mut members = self.members.lock().unwrap_or_else(|p| p.into_inner());
            members.retain(|m| m.strong_count() > 0);
            members.iter().filter_map(Weak::upgrade).collect()
        };
        let entries: Vec<(String, String)> = members
            .iter()
            .filter_map(|m| Some((m.image_name().to_string(), m.vouched_holder()?)))
            .collect();
        let mut vouched_nothing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        if entries.is_empty() && *vouched_nothing {
            return Ok(());
        }
        let count = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        let text = render(count, &entries);
        let written = self.pool.write_object(&self.object, text.as_bytes());
        match &written {
            Ok(()) => {
                *vouched_nothing = entries.is_empty();
                if self.failing.swap(false, Ordering::Relaxed) {
                    tracing::info!(
                        "gateway heartbeat {} in pool {} written again",
                        self.object,
                        self.pool.name()
                    );
                }
            }
            Err(e) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!("cannot write the gateway heartbeat {} in pool {}: {e} (other gateways take this one's images over if it stays silent)", self.object, self.pool.name());
                }
            }
        }
        written
    }

    /// What gateway `peer`'s heartbeat says of `image` held by `holder`, from its object as
    /// read within [`PEER_FRESH`].
    pub fn peer_says(&self, peer: &str, image: &str, holder: &str) -> Result<PeerSays, rbd::Error> {
        let slot = Arc::clone(
            self.peers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(peer.to_string())
                .or_default(),
        );
        // Held while reading: the looks of the pool's other images wait for this answer
        // instead of each reading the same object.
        let mut seen = slot.lock().unwrap_or_else(|p| p.into_inner());
        let stale = seen
            .as_ref()
            .is_none_or(|s| s.read_at.elapsed() >= PEER_FRESH);
        if stale {
            let object = format!("{BEAT_OBJECT_PREFIX}{peer}");
            let data = self.pool.read_object(&object, OBJECT_BYTES_MAX)?;
            *seen = Some(PeerBeat {
                read_at: Instant::now(),
                beat: data.as_deref().map(parse),
            });
        }
        let beat = seen.as_ref().and_then(|s| s.beat.as_ref());
        Ok(match beat {
            None => PeerSays::Nothing,
            Some(beat) => match beat.holders.get(image) {
                Some(vouched) if vouched == holder => {
                    PeerSays::Beat(super::policy::beat_value(holder, &beat.count))
                }
                _ => PeerSays::Silent,
            },
        })
    }
}

/// The heartbeat's thread: a beat every [`BEAT_INTERVAL`] while any image uses it.
fn beat_while_used(beat: Weak<PoolBeat>) {
    loop {
        std::thread::sleep(BEAT_INTERVAL);
        let Some(beat) = beat.upgrade() else {
            return;
        };
        // (A failure is logged once by `publish`; the next beat tries again.)
        let _ = beat.publish();
    }
}

/// The object's text: the format line, `count N`, then `IMAGE<TAB>HOLDER` per owned image.
/// A name with a tab or a line break cannot be written: that image is vouched for by no
/// heartbeat (the other gateways judge its owner by the cluster's watch alone).
fn render(count: u64, entries: &[(String, String)]) -> String {
    let mut text = format!("{FORMAT_LINE}\ncount {count}\n");
    let plain = |s: &str| !s.contains(['\t', '\n', '\r']);
    for (image, holder) in entries {
        if plain(image) && plain(holder) {
            text.push_str(&format!("{image}\t{holder}\n"));
        }
    }
    text
}

/// A peer's object; anything else than this format reads as a heartbeat vouching for nothing.
fn parse(data: &[u8]) -> Parsed {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.lines();
    let mut parsed = Parsed {
        count: String::new(),
        holders: HashMap::new(),
    };
    if lines.next() != Some(FORMAT_LINE) {
        return parsed;
    }
    if let Some(count) = lines.next().and_then(|l| l.strip_prefix("count ")) {
        parsed.count = count.to_string();
    }
    for line in lines {
        if let Some((image, holder)) = line.split_once('\t') {
            parsed.holders.insert(image.to_string(), holder.to_string());
        }
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_reads_back_as_written() {
        let entries = vec![
            (
                "disk-a".to_string(),
                "client.4101 10.0.0.5:0/305".to_string(),
            ),
            (
                "disk b".to_string(),
                "client.4102 10.0.0.5:0/306".to_string(),
            ),
        ];
        let parsed = parse(render(7, &entries).as_bytes());
        assert_eq!(parsed.count, "7");
        assert_eq!(parsed.holders.len(), 2);
        assert_eq!(parsed.holders["disk b"], "client.4102 10.0.0.5:0/306");
    }

    #[test]
    fn names_that_cannot_be_written_are_left_out_and_foreign_data_vouches_for_nothing() {
        let entries = vec![
            ("tab\there".to_string(), "h1".to_string()),
            ("ok".to_string(), "h2\nforged\th3".to_string()),
            ("fine".to_string(), "h4".to_string()),
        ];
        let parsed = parse(render(1, &entries).as_bytes());
        assert_eq!(parsed.holders.len(), 1);
        assert_eq!(parsed.holders["fine"], "h4");
        let foreign = parse(b"count 9\nfine\th4\n");
        assert!(foreign.holders.is_empty());
        assert!(parse(&[0xff, 0xfe, b'\n']).holders.is_empty());
    }
}
