//! Durable memory: a component's arena keeps what its incarnations wrote
//! across micro-reboots (from a warm standby, and from a re-exec'd pristine
//! image alike), and a client maps a page of its server's pool and reads
//! what the server wrote there.

mod common;

use common::*;

/// Runs bench-echo (arena and pool) under `reboot`, killed `kills` times,
/// with a probe as its client; returns kintsugi's stdout.
fn run_killed(test: &str, reboot: &str, kills: u32) -> String {
    let seed = seed(test);
    let dir = scratch(test);
    let system = write(
        &dir,
        "durable.toml",
        &format!(
            r#"
[system]
name = "durable"

[[component]]
name = "echo"
binary = "kintsugi-bench-echo"
provides = ["bench"]
reboot = "{reboot}"
arena_kib = 8
pool_kib = 16
restart = {{ max = 100, window_ms = 1000 }}

[[component]]
name = "probe"
binary = "kintsugi-probe"
uses = ["bench"]
arena_kib = 4
"#
        ),
    );
    let tag = unique_tag(test);
    let out = run_system(&tag, &system)
        .args(["--kill", "echo"])
        .args(["--kills", &kills.to_string(), "--kill-every", "100..150"])
        .args(["--seed", &seed.to_string(), "--duration", "4"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(crashes(&stdout, "echo").len(), kills as usize, "{stdout}");
    assert!(
        leftovers(&tag).is_empty(),
        "processes left behind: {:?}",
        leftovers(&tag)
    );
    let _ = std::fs::remove_dir_all(dir);
    stdout
}

/// Checks echo's incarnation counts: each incarnation found the count its
/// predecessors left in the arena, and the last one is the `kills + 1`th.
fn assert_counted(stdout: &str, kills: u32) {
    let counts: Vec<(u64, u64)> = json_lines(stdout)
        .iter()
        .filter(|v| v["component"] == "echo")
        .map(|v| {
            (
                v["epoch"].as_u64().unwrap(),
                v["incarnations"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(!counts.is_empty(), "echo reported no count:\n{stdout}");
    for (epoch, n) in &counts {
        assert_eq!(epoch, n, "incarnation {epoch} counted {n}:\n{stdout}");
    }
    assert_eq!(
        counts.last().unwrap().1,
        u64::from(kills) + 1,
        "the counter survived every reboot:\n{stdout}"
    );
}

#[test]
fn the_arena_survives_micro_reboots_and_clients_read_the_servers_pool() {
    let kills = 5;
    let stdout = run_killed("durable-standby", "standby", kills);
    assert_counted(&stdout, kills);

    let probe = json_lines(&stdout)
        .into_iter()
        .find(|v| v["component"] == "probe")
        .unwrap_or_else(|| panic!("no report from the probe:\n{stdout}"));
    assert_eq!(
        probe["pools"]["bench"], "pool of echo",
        "the probe maps the page echo wrote: {probe}"
    );
    let channels: Vec<&str> = probe["channels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    let holds = |name: &str| channels.iter().any(|c| c.contains(name));
    assert!(holds("kintsugi:echo:pool"), "{channels:?}");
    assert!(holds("kintsugi:probe:arena"), "{channels:?}");
    assert!(
        !holds("kintsugi:echo:arena"),
        "a client must not hold its server's arena: {channels:?}"
    );
}

#[test]
fn a_reexeced_pristine_image_maps_the_same_arena() {
    let kills = 3;
    let stdout = run_killed("durable-exec", "exec", kills);
    assert_counted(&stdout, kills);
}
