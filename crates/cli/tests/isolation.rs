//! A component can reach only the interfaces its system description grants:
//! it holds no descriptor of any other channel, and the runtime refuses to
//! connect it to one; and it cannot reach another component's channels or
//! memfds through `/proc` either (its own and the supervisor's processes
//! are not dumpable, and it holds no `CAP_SYS_PTRACE`); and it may make
//! only the system calls the runtime needs and its description adds.

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
syscalls = ["socket", "openat"]
cpus = [0]
config = { siblings = 4 }

[[component]]
name = "outsider"
binary = "kintsugi-probe"
config = { siblings = 4 }
"#,
    );
    let tag = unique_tag("isolation");
    // Started with a descriptor its parent left open (not close-on-exec),
    // which no component may inherit.
    let marker = write(&dir, "inherited-marker", "secret");
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg("exec 7<\"$1\"; shift; exec \"$@\"")
        .arg("bash")
        .arg(&marker)
        .arg(env!("CARGO_BIN_EXE_kintsugi"))
        .args(["run", system.to_str().unwrap(), "--duration", "1.5"])
        .env("KINTSUGI_TEST_TAG", &tag)
        .env("KINTSUGI_LOG", "warn")
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

    // `cpus` pins a component; one without runs where the supervisor may.
    assert_eq!(insider["cpus"], "0", "{insider}");
    let ours = std::fs::read_to_string("/proc/self/status").unwrap();
    let ours = ours
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    let outsider = probe("outsider");
    assert_eq!(outsider["cpus"], ours, "{outsider}");
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
    for p in [&insider, &outsider] {
        let open = p["open"].as_array().unwrap();
        assert!(
            open.iter()
                .all(|t| !t.as_str().unwrap().contains("inherited-marker")),
            "{open:?}"
        );
    }
    // Neither the supervisor's descriptors nor those of another component
    // (its zygote, its standby, ramfs and theirs) open through /proc.
    for p in [&insider, &outsider] {
        assert_eq!(p["supervisor_fds_opened"], 0, "{p}");
        let why = p["supervisor_fds_error"].as_str().unwrap_or_default();
        assert!(why.contains("denied"), "{p}");
        assert!(p["siblings"].as_u64().unwrap() >= 4, "{p}");
        assert_eq!(p["sibling_fds_opened"], 0, "{p}");
    }
    // And each runs with no_new_privs and no capability (the default) but
    // CAP_SYS_NICE (bit 23) where the supervisor cannot set priority
    // limits instead; run by root, the others left its bounding set.
    let root = rustix::process::geteuid().is_root();
    for p in [&insider, &outsider] {
        assert_eq!(p["no_new_privs"], "1", "{p}");
        // Filtered (mode 2), and a call no component needs is refused.
        assert_eq!(p["seccomp"], "2", "{p}");
        assert_eq!(
            p["process_vm_readv"], "EPERM: Operation not permitted",
            "{p}"
        );
        // A call outside the runtime's allow list is refused unless the
        // description adds it (the insider's `syscalls`).
        let outcome = match p == &insider {
            true => "ok",
            false => "Operation not permitted (os error 1)",
        };
        assert_eq!(p["socket"], outcome, "{p}");
        // Files open for reading only, unless the description adds `openat`.
        assert_eq!(p["open_for_writing"], outcome, "{p}");
        let sets: &[&str] = if root {
            &["cap_eff", "cap_bnd"]
        } else {
            &["cap_eff"]
        };
        for set in sets {
            let mask = u64::from_str_radix(p[*set].as_str().unwrap(), 16).unwrap();
            assert_eq!(mask & !(1 << 23), 0, "{set}: {p}");
        }
    }
    assert!(leftovers(&tag).is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

/// `user = …` runs a component's processes as that user (no supplementary
/// group), exec'd by the supervisor even where the user may not search the
/// binary's folders, keeping only the capabilities its description grants
/// (as ambient ones); one component then cannot signal another's processes.
#[test]
fn a_component_runs_as_its_own_user_and_cannot_signal_another() {
    assert!(
        rustix::process::geteuid().is_root(),
        "switching users needs the supervisor to run as root"
    );
    let dir = scratch("users");
    let system = write(
        &dir,
        "users.toml",
        r#"
[system]
name = "users"

[[component]]
name = "ramfs"
binary = "kintsugi-ramfs"
provides = ["fs"]

[[component]]
name = "insider"
binary = "kintsugi-probe"
uses = ["fs"]
user = "nobody"
config = { siblings = 4 }

[[component]]
name = "outsider"
binary = "kintsugi-probe"
user = 1
capabilities = ["net_bind_service"]
config = { siblings = 4 }
"#,
    );
    let tag = unique_tag("users");
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
            .find(|v| v["component"] == name && v.get("uid").is_some())
            .cloned()
            .unwrap_or_else(|| panic!("no report from {name}:\n{stdout}"))
    };
    let ids = |v: &serde_json::Value, key: &str| -> Vec<u32> {
        v[key]
            .as_str()
            .unwrap()
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect()
    };
    let insider = probe("insider");
    let outsider = probe("outsider");
    // Real, effective, saved and file-system ids all switched.
    assert_eq!(ids(&insider, "uid"), [65534; 4], "{insider}");
    assert_eq!(ids(&insider, "gid"), [65534; 4], "{insider}");
    assert_eq!(ids(&outsider, "uid"), [1; 4], "{outsider}");
    assert_eq!(ids(&outsider, "gid"), [1; 4], "{outsider}");
    for p in [&insider, &outsider] {
        assert_eq!(p["groups"], "", "no supplementary group: {p}");
        assert_eq!(p["comm"], "kintsugi-probe", "{p}");
        assert_eq!(p["no_new_privs"], "1", "{p}");
        assert_eq!(p["seccomp"], "2", "{p}");
        // It still serves and calls as any component: the insider's fs
        // connection was granted.
        // Another user's processes (ramfs's, the other probe's) are out of
        // reach of its signals; its own (its zygote, its standby) are not.
        let mine = ids(p, "uid")[0];
        let signals = p["sibling_signals"].as_array().unwrap();
        assert!(signals.len() >= 4, "{p}");
        for s in signals {
            let own = s["uid"].as_u64() == Some(u64::from(mine));
            assert_eq!(s["signal"].as_bool(), Some(own), "{s} from {p}");
        }
    }
    assert_eq!(insider["connect"]["fs"], "granted");
    // Capabilities: the granted one effective, permitted and ambient
    // (CAP_NET_BIND_SERVICE is bit 10), besides CAP_SYS_NICE where the
    // supervisor cannot set priority limits instead; nothing for the other.
    let mask = |p: &serde_json::Value, set: &str| {
        u64::from_str_radix(p[set].as_str().unwrap(), 16).unwrap() & !(1 << 23)
    };
    assert_eq!(mask(&outsider, "cap_eff"), 1 << 10, "{outsider}");
    assert_eq!(mask(&outsider, "cap_amb"), 1 << 10, "{outsider}");
    assert_eq!(mask(&insider, "cap_eff"), 0, "{insider}");
    assert_eq!(mask(&insider, "cap_amb"), 0, "{insider}");
    assert!(leftovers(&tag).is_empty());
    let _ = std::fs::remove_dir_all(dir);
}
