//! A component can reach only the interfaces its system description grants:
//! it holds no descriptor of any other channel, and the runtime refuses to
//! connect it to one.

mod common;

use common::*;

#[test]
fn only_granted_interfaces_are_reachable() {
    let dir = scratch("isolation");
    let system = write(
        &dir,
        "iso.toml",
        r#"
[system]
name = "isolation"

[[component]]
name = "ramfs"
binary = "kintsugi-ramfs"
provides = ["fs"]

[[component]]
name = "insider"
binary = "kintsugi-probe"
uses = ["fs"]

[[component]]
name = "outsider"
binary = "kintsugi-probe"
"#,
    );
    let tag = unique_tag("isolation");
    let out = kintsugi(&tag)
        .args(["run", system.to_str().unwrap(), "--duration", "1.5"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let lines = json_lines(&stdout);
    let probe = |name: &str| {
        lines
            .iter()
            .find(|v| v["component"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no report from {name}:\n{stdout}"))
    };

    let insider = probe("insider");
    assert_eq!(insider["connect"]["fs"], "granted");
    let channels = insider["channels"].as_array().unwrap();
    assert_eq!(
        channels.len(),
        2,
        "its control block and its one edge: {channels:?}"
    );
    assert!(channels
        .iter()
        .any(|c| c.as_str().unwrap().contains("insider->ramfs:fs")));

    let outsider = probe("outsider");
    let refusal = outsider["connect"]["fs"].as_str().unwrap();
    assert!(refusal.contains("not granted interface `fs`"), "{refusal}");
    assert!(outsider["connect"]["bench"]
        .as_str()
        .unwrap()
        .contains("not granted"));
    let channels = outsider["channels"].as_array().unwrap();
    assert!(
        channels.iter().all(|c| !c.as_str().unwrap().contains("->")),
        "outsider holds an edge: {channels:?}"
    );
    assert!(leftovers(&tag).is_empty());
    let _ = std::fs::remove_dir_all(dir);
}
