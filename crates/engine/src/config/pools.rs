//! The rules of a `[[pool]]`, in one place for the config file (`file::resolve_pools`) and for
//! `ctl pool add`, which builds a [`PoolConfig`] from its arguments and must refuse what a
//! config file would refuse before it creates a directory or runs an LVM tool.

use std::path::{Path, PathBuf};

use super::names::{
    check_lvm_lv_name, check_lvm_vg_name, check_object_name, check_path_text, check_rbd_pool_name,
};
use super::{Invalid, PoolConfig, PoolKind};

impl PoolConfig {
    /// The pool as the store makes, snapshots, clones and removes its volumes
    /// (`store::pool`): what the control plane asks instead of the kind.
    pub fn medium(&self) -> store::pool::Pool {
        match &self.kind {
            PoolKind::Dir { path } => store::pool::Pool::Dir(store::dir_pool::DirPool::new(path)),
            PoolKind::Rbd { pool, conf, client } => store::pool::Pool::Rbd(store::RbdSpec {
                pool: pool.clone(),
                image: String::new(),
                conf: conf.clone(),
                client: client.clone(),
            }),
            PoolKind::Lvm(thin) => store::pool::Pool::Lvm(thin.clone()),
        }
    }

    /// Why `self`'s volumes would be `other`'s too, if they would (the key it is about): a
    /// volume's device names its directory, its VG (`/dev/VG/NAME`, not its thin pool) or its
    /// Ceph pool, so two pools there could not tell whose a volume is.
    pub(crate) fn shares_volumes_with(&self, other: &PoolConfig) -> Option<(&'static str, String)> {
        let why =
            |key, what: String| Some((key, format!("{what} is pool {}'s already", other.name)));
        match (&self.kind, &other.kind) {
            (PoolKind::Dir { path: a }, PoolKind::Dir { path: b }) if a == b => {
                why("path", format!("directory {}", a.display()))
            }
            (PoolKind::Lvm(a), PoolKind::Lvm(b)) if a.vg == b.vg => why(
                "vg",
                format!("volume group {} (one pool per VG: an LV's device path does not name its thin pool)", a.vg),
            ),
            (
                PoolKind::Rbd { pool: a, conf: ca, .. },
                PoolKind::Rbd { pool: b, conf: cb, .. },
            ) if a == b && ca == cb => why("pool", format!("Ceph pool {a}")),
            _ => None,
        }
    }

    /// Checks the pool as loading a config checks a `[[pool]]` (`roots`: the server's
    /// `device_roots`): its name, and its kind's names and paths. The error names the key it
    /// is about (`vg: …`). Whether another pool has the name, and whether the VG or directory
    /// exists, are the caller's to ask.
    pub fn check(&self, roots: &[PathBuf]) -> Result<(), Invalid> {
        match self.problems(roots).into_iter().next() {
            Some((key, why)) => Err(Invalid(format!("{key}: {why}"))),
            None => Ok(()),
        }
    }

    /// Every problem of the pool, each with the `[[pool]]` key it is about.
    pub(crate) fn problems(&self, roots: &[PathBuf]) -> Vec<(&'static str, Invalid)> {
        let mut out = Vec::new();
        let mut check = |key, result: Result<(), Invalid>| {
            if let Err(why) = result {
                out.push((key, why));
            }
        };
        check("name", check_object_name(&self.name));
        match &self.kind {
            PoolKind::Dir { path } => check("path", dir_path(path, roots)),
            PoolKind::Rbd { pool, conf, client } => {
                check("pool", check_rbd_pool_name(pool));
                if let Some(conf) = conf {
                    check("ceph_conf", ceph_conf(conf));
                }
                if let Some(client) = client {
                    check("ceph_client", ceph_client(client));
                }
            }
            PoolKind::Lvm(thin) => {
                check("vg", check_lvm_vg_name(&thin.vg));
                check("thin_pool", check_lvm_lv_name(&thin.pool));
            }
        }
        out
    }

    /// Checks the name of a new volume of this pool: an object name, and for an LVM pool an
    /// LV name too (the volume is the LV of that name).
    pub fn check_volume_name(&self, name: &str) -> Result<(), Invalid> {
        check_object_name(name)?;
        match &self.kind {
            PoolKind::Lvm(_) => check_lvm_lv_name(name),
            PoolKind::Dir { .. } | PoolKind::Rbd { .. } => Ok(()),
        }
    }

    /// Checks the name of a new snapshot of `volume` in this pool: an object name, and for an
    /// LVM pool the LV that holds it (`VOLUME+SNAPSHOT`) an LV name.
    pub fn check_snapshot_name(&self, volume: &str, snapshot: &str) -> Result<(), Invalid> {
        check_object_name(snapshot)?;
        match &self.kind {
            PoolKind::Lvm(_) => check_lvm_lv_name(&store::lvm::snapshot_lv(volume, snapshot)),
            PoolKind::Dir { .. } | PoolKind::Rbd { .. } => Ok(()),
        }
    }
}

/// A directory pool's directory: absolute, no control character, within the device roots.
fn dir_path(path: &Path, roots: &[PathBuf]) -> Result<(), Invalid> {
    path_text(path)?;
    if !path.is_absolute() {
        return Err(Invalid("must be an absolute path".into()));
    }
    super::within_roots(path, roots)
}

fn ceph_conf(conf: &Path) -> Result<(), Invalid> {
    if conf.as_os_str().is_empty() {
        return Err(Invalid("must not be empty".into()));
    }
    path_text(conf)
}

/// [`check_path_text`] of a path made in memory; one that is no UTF-8 is refused too, as no
/// config file could hold it.
fn path_text(path: &Path) -> Result<(), Invalid> {
    match path.to_str() {
        Some(s) => check_path_text(s),
        None => Err(Invalid(format!("{path:?} is not UTF-8"))),
    }
}

fn ceph_client(client: &str) -> Result<(), Invalid> {
    if client.is_empty() || client.chars().any(char::is_control) {
        return Err(Invalid(format!(
            "{client:?}: must be a Ceph client name like \"client.iscsi\""
        )));
    }
    Ok(())
}
