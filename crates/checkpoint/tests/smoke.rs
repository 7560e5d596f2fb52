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
