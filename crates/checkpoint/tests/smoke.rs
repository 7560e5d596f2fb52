mod common;

use common::Target;
use kintsugi_checkpoint::Checkpointer;

#[test]
fn written_pages_are_found_and_restored_in_place() {
    let mut t = Target::start(7, 4 << 20, 8, 4, true);
    let mut c = Checkpointer::attach(t.pid()).unwrap();
    let first = c.checkpoint().unwrap();
    eprintln!("first: {first:?}");
    assert!(first.pages >= 1024, "{first:?}");
    let at_checkpoint = t.digest().unwrap();
    let again = c.checkpoint().unwrap();
    eprintln!("again: {again:?}");
    t.cmd("mutate 100 5").unwrap();
    let third = c.checkpoint().unwrap();
    eprintln!("after 10%: {third:?}");
    assert!(third.pages >= 90 && third.pages < 400, "{third:?}");
    let at = t.digest().unwrap();
    assert_ne!(at, at_checkpoint);
    t.cmd("mutate 500 6").unwrap();
    t.cmd("map 5 9").unwrap();
    t.cmd("unmap 3 10").unwrap();
    assert_ne!(t.digest().unwrap(), at);
    let r = c.restore_in_place().unwrap();
    eprintln!("restore: {r:?}");
    assert_eq!(t.digest().unwrap(), at);
    t.cmd("mutate 300 11").unwrap();
    t.digest().unwrap();
}

/// A target (seeded `seed`) with a checkpointer that keeps what a take-back
/// needs, after two checkpoints (pages written between them); the target's
/// digest at the second.
fn sound_checkpoint(seed: u64) -> (Target, Checkpointer, String) {
    let mut t = Target::start(seed, 4 << 20, 8, 4, true);
    let mut c = Checkpointer::attach(t.pid()).unwrap();
    c.keep_previous(true);
    c.checkpoint().unwrap();
    t.cmd("mutate 100 5").unwrap();
    c.checkpoint().unwrap();
    let sound = t.digest().unwrap();
    (t, c, sound)
}

/// A checkpoint taken back leaves the one before it as the image: pages
/// written, mappings made and mappings removed between the two come back
/// as the first had them, and the checkpoint after copies every page.
#[test]
fn a_checkpoint_taken_back_leaves_the_one_before() {
    let (mut t, mut c, sound) = sound_checkpoint(8);
    let seq = c.image().seq;
    t.cmd("mutate 300 6").unwrap();
    t.cmd("map 5 9").unwrap();
    t.cmd("unmap 3 10").unwrap();
    let damaged = t.digest().unwrap();
    assert_ne!(damaged, sound);
    c.checkpoint().unwrap();
    assert!(c.take_back(), "the latest checkpoint is taken back");
    assert!(!c.take_back(), "only the latest");
    assert_eq!(c.image().seq, seq);
    c.restore_in_place().unwrap();
    assert_eq!(t.digest().unwrap(), sound, "the one before, restored");
    t.cmd("mutate 50 7").unwrap();
    let next = c.checkpoint().unwrap();
    assert!(
        next.pages >= 1024,
        "every page copied after a take-back: {next:?}"
    );
    let now = t.digest().unwrap();
    t.cmd("mutate 200 8").unwrap();
    c.restore_in_place().unwrap();
    assert_eq!(t.digest().unwrap(), now);
}

/// The same with the taken-back checkpoint read ahead first and the target
/// writing between the read-ahead and the pause: the pages read ahead get
/// the sound checkpoint's bytes back too.
#[test]
fn a_checkpoint_read_ahead_and_taken_back_leaves_the_one_before() {
    let (mut t, mut c, sound) = sound_checkpoint(9);
    t.cmd("mutate 300 6").unwrap();
    let taken = c
        .with_read_ahead(|c| {
            t.cmd("mutate 200 7").unwrap();
            c.checkpoint()
        })
        .unwrap();
    assert!(taken.read_ahead > 0, "pages were read ahead: {taken:?}");
    assert!(c.take_back());
    c.restore_in_place().unwrap();
    assert_eq!(t.digest().unwrap(), sound, "the one before, restored");
}
