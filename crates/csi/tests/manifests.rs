//! The manifests in deploy/kubernetes/ name what the binary is: its driver name, its flags.

use std::process::Command;

use ferrosan_csi::identity::DRIVER_NAME;

fn manifest(name: &str) -> String {
    let path = format!(
        "{}/../../deploy/kubernetes/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_manifests_name_the_driver_and_flags_the_binary_has() {
    let deploy = manifest("ferrosan-csi.yaml");
    let classes = manifest("storageclass.yaml");
    assert!(deploy.contains(&format!("name: {DRIVER_NAME}\n")));
    assert!(classes.contains(&format!("provisioner: {DRIVER_NAME}\n")));
    assert!(classes.contains(&format!("driver: {DRIVER_NAME}\n")));
    let help = Command::new(env!("CARGO_BIN_EXE_ferrosan-csi"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    let flags: Vec<&str> = deploy
        .split(|c: char| c.is_whitespace() || matches!(c, '[' | ',' | ']'))
        .filter(|w| w.starts_with("--") && w.contains('='))
        .filter_map(|w| w.split('=').next())
        .filter(|f| !f.starts_with("--csi-address") && !f.starts_with("--kubelet"))
        .collect();
    assert!(flags.len() >= 8, "{flags:?}");
    for flag in flags {
        assert!(help.contains(flag), "{flag} is not a flag of ferrosan-csi");
    }
}
