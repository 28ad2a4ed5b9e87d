//! The gateways' ownership decisions, from what a gateway sees of an image through the
//! cluster, with the time passed in: whether the owner lives, when a non-owner takes the image
//! over by itself, whether an initiator may move it, and how long a gateway keeps its view
//! while it cannot look. Nothing here calls the cluster.

use std::time::{Duration, Instant};

/// How often the owner writes its heartbeat into the image's metadata.
pub const BEAT_INTERVAL: Duration = Duration::from_secs(1);

/// An owner whose heartbeat has not moved for this long is no longer known to be alive: an
/// initiator's SET TARGET PORT GROUPS may take the image from it, and a non-owner stops
/// shipping commands to it (they would wait for an owner that may be hung).
pub const BEAT_LATE: Duration = Duration::from_millis(2500);

/// The cluster's word that the owner's client is gone (its watch on the image dropped while it
/// holds the lock) must hold for this long -- two looks -- before the image is taken: a live
/// client's watch can be missing for a moment while librbd re-establishes it.
pub const GONE_CONFIRM: Duration = Duration::from_secs(2);

/// A look at the cluster that took longer than this was slowed by the cluster itself (an OSD
/// peering, a monitor election, a loaded host), and the owner's heartbeat writes may have been
/// held up as much: the time such a look took does not count toward the owner's silence. A
/// cluster that stays slow stretches the grace; it does not cancel it.
pub const SLOW_LOOK: Duration = Duration::from_secs(1);

/// How long a gateway keeps its last view of an image's owner while it cannot look (the
/// cluster refused or did not answer): a single slow or failed call under load must not flap
/// every initiator's path state (each flip is a unit attention, and a non-owner that knows no
/// owner answers NOT READY instead of shipping). Keeping the view is safe: the fence, not this
/// view, keeps a stale owner's writes out.
pub const BLIND_GRACE: Duration = Duration::from_secs(3);

/// What the owner key holds: the gateway that owns the image and, after a space, the lock
/// holder as librbd names it (the client's address).
#[derive(Debug, PartialEq, Eq)]
pub struct OwnerRecord<'a> {
    pub gateway: &'a str,
    /// The lock holder it recorded; absent in records written before holders were kept.
    pub holder: Option<&'a str>,
}

pub fn parse_owner(value: &str) -> Option<OwnerRecord<'_>> {
    let value = value.trim();
    if value.is_empty() {
        return None;
    }
    Some(match value.split_once(char::is_whitespace) {
        Some((gateway, holder)) => OwnerRecord {
            gateway,
            holder: Some(holder.trim()).filter(|h| !h.is_empty()),
        },
        None => OwnerRecord {
            gateway: value,
            holder: None,
        },
    })
}

/// An owner's heartbeat for one image: its lock holder and a count, `HOLDER COUNT`.
pub fn beat_value(holder: &str, count: impl std::fmt::Display) -> String {
    format!("{holder} {count}")
}

/// The holder a heartbeat value names.
fn beat_holder(value: &str) -> Option<&str> {
    value.trim().rsplit_once(' ').map(|(holder, _)| holder)
}

/// The cluster's view of the client holding the image's lock (the owner gateway's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnerSeen {
    /// The holder watches the image (None: several clients hold the lock, which is no lock a
    /// gateway took: never acted on).
    Present { holder: Option<String> },
    /// The lock is held by a client that no longer watches the image: dead, or cut off from the
    /// cluster for longer than the OSDs' watch timeout.
    Gone { holder: String },
    /// Nobody holds the lock (the owner closed the image: a clean shutdown).
    Unlocked,
}

pub fn judge(holders: &[String], watchers: &[String]) -> OwnerSeen {
    match holders {
        [] => OwnerSeen::Unlocked,
        [holder] => {
            let address = rbd::plain_address(holder);
            if watchers.iter().any(|w| rbd::plain_address(w) == address) {
                OwnerSeen::Present {
                    holder: Some(holder.clone()),
                }
            } else {
                OwnerSeen::Gone {
                    holder: holder.clone(),
                }
            }
        }
        _ => OwnerSeen::Present { holder: None },
    }
}

/// Why a non-owner doubts the owner (for its log line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Doubt {
    /// The cluster no longer hears from the owner's client.
    Gone,
    /// Nobody holds the image.
    Unlocked,
    /// The owner's heartbeat stopped while the cluster still hears from its client: hung, or
    /// cut off from the cluster for less than the watch timeout.
    Silent,
}

/// What a non-owner does after a look.
#[derive(Debug, PartialEq, Eq)]
pub enum Vigil {
    /// Nothing (the owner lives, or has not been silent long enough).
    Wait,
    /// The owner just came into doubt: worth a log line.
    Noticed(Doubt),
    /// Take the image, fencing this lock holder first (None: nobody holds it).
    Take(Option<String>),
}

/// The owner's heartbeat as last seen, and when it last moved.
#[derive(Debug)]
struct Beat {
    holder: String,
    value: String,
    moved: Instant,
    noticed: bool,
}

/// A non-owner's judgement of the owner. The owner is alive while the cluster hears from its
/// client and its heartbeat moves; a holder that never wrote one (a gateway of an older
/// release) is judged by the cluster alone. The image is taken when the owner was silent for
/// `grace`, when the cluster says its client is gone ([`GONE_CONFIRM`]), or when nobody held
/// the image for `grace`. A zero grace: judged, never taken by itself.
#[derive(Debug)]
pub struct OwnerVigil {
    grace: Duration,
    gone_since: Option<(OwnerSeen, Instant)>,
    beat: Option<Beat>,
}

impl OwnerVigil {
    pub fn new(grace: Duration) -> OwnerVigil {
        OwnerVigil {
            grace,
            gone_since: None,
            beat: None,
        }
    }

    /// One look, begun at `began`: the cluster's view of the lock holder and the heartbeat value
    /// stored now.
    pub fn look(
        &mut self,
        seen: OwnerSeen,
        beat: Option<&str>,
        began: Instant,
        now: Instant,
    ) -> Vigil {
        match seen {
            OwnerSeen::Present {
                holder: Some(holder),
            } => {
                self.gone_since = None;
                self.note_beat(&holder, beat, now);
                let took = now.saturating_duration_since(began);
                if took > SLOW_LOOK {
                    if let Some(b) = &mut self.beat {
                        b.moved = b.moved.checked_add(took).map_or(now, |m| m.min(now));
                    }
                }
                self.judge_silence(holder, now)
            }
            OwnerSeen::Present { holder: None } => {
                self.reset();
                Vigil::Wait
            }
            // (The heartbeat seen stays: a watch back after a look without it does not make an
            // old beat new.)
            gone => self.judge_gone(gone, now),
        }
    }

    fn note_beat(&mut self, holder: &str, value: Option<&str>, now: Instant) {
        let value = value.filter(|v| beat_holder(v) == Some(holder));
        match (&mut self.beat, value) {
            (Some(beat), Some(value)) if beat.holder == holder => {
                if beat.value != value {
                    beat.value = value.to_string();
                    beat.moved = now;
                    beat.noticed = false;
                }
            }
            (_, Some(value)) => {
                self.beat = Some(Beat {
                    holder: holder.to_string(),
                    value: value.to_string(),
                    moved: now,
                    noticed: false,
                })
            }
            // No heartbeat of this holder: judged by the cluster's watch alone.
            (_, None) => self.beat = None,
        }
    }

    fn judge_silence(&mut self, holder: String, now: Instant) -> Vigil {
        let grace = self.grace;
        let Some(beat) = &mut self.beat else {
            return Vigil::Wait;
        };
        let quiet = now.saturating_duration_since(beat.moved);
        if !grace.is_zero() && quiet >= grace {
            self.reset();
            return Vigil::Take(Some(holder));
        }
        if quiet >= BEAT_LATE && !beat.noticed {
            beat.noticed = true;
            return Vigil::Noticed(Doubt::Silent);
        }
        Vigil::Wait
    }

    fn judge_gone(&mut self, seen: OwnerSeen, now: Instant) -> Vigil {
        let (wait, doubt, fence) = match &seen {
            OwnerSeen::Gone { holder } => (
                GONE_CONFIRM.min(self.grace),
                Doubt::Gone,
                Some(holder.clone()),
            ),
            _ => (self.grace, Doubt::Unlocked, None),
        };
        match &self.gone_since {
            Some((before, since)) if *before == seen => {
                if !self.grace.is_zero() && now.saturating_duration_since(*since) >= wait {
                    self.reset();
                    Vigil::Take(fence)
                } else {
                    Vigil::Wait
                }
            }
            _ => {
                self.gone_since = Some((seen, now));
                Vigil::Noticed(doubt)
            }
        }
    }

    /// How long the owner's heartbeat has not moved, as last seen (zero for an owner that
    /// writes none).
    pub fn silence(&self, now: Instant) -> Duration {
        self.beat
            .as_ref()
            .map_or(Duration::ZERO, |b| now.saturating_duration_since(b.moved))
    }

    /// Whether the owner is known to be alive: the cluster hears from its client and its
    /// heartbeat (if it writes one) moved within [`BEAT_LATE`].
    pub fn owner_alive(&self, now: Instant) -> bool {
        if self.gone_since.is_some() {
            return false;
        }
        self.beat
            .as_ref()
            .is_none_or(|b| now.saturating_duration_since(b.moved) < BEAT_LATE)
    }

    /// Forgets what was seen (the cluster did not answer, a takeover ran or failed): the
    /// grace starts over.
    pub fn reset(&mut self) {
        self.gone_since = None;
        self.beat = None;
    }
}

/// Who asks for a takeover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asker {
    /// An initiator's SET TARGET PORT GROUPS through this gateway's port.
    Initiator,
    /// The operator (`ferrosan ctl device take`).
    Operator,
}

/// Whether a takeover asked for by `asker` goes ahead. An initiator never takes the image from
/// an owner known to be alive: Linux's ALUA handler sends SET TARGET PORT GROUPS whenever it
/// activates a path, so a gateway that comes back would otherwise take the image back from the
/// one serving it (a second outage per fault). Failback is the operator's.
pub fn may_take(asker: Asker, owner_alive: bool) -> bool {
    asker == Asker::Operator || !owner_alive
}

/// How long a gateway has been unable to see who owns an image.
#[derive(Debug, Default)]
pub struct Sight {
    /// When the first look of the current run of failed looks began.
    failing_since: Option<Instant>,
}

impl Sight {
    /// A look succeeded.
    pub fn seen(&mut self) {
        self.failing_since = None;
    }

    /// The look begun at `started` failed at `now`: whether to give up the last view (the
    /// looks have failed for [`BLIND_GRACE`] since the first of them began, or this gateway
    /// was fenced, which it must act on at once).
    pub fn failed(&mut self, started: Instant, now: Instant, fenced: bool) -> bool {
        let since = *self.failing_since.get_or_insert(started);
        fenced || now.saturating_duration_since(since) >= BLIND_GRACE
    }
}

#[cfg(test)]
mod tests;
