//! A rollout's hand-over of a socket path: the successor waits while the predecessor still
//! serves it, and the predecessor's clean-up leaves the successor's file alone.

use std::time::Duration;

use gpushare_proto::socket_file::{BoundSocket, Released, served, wait_until_released};

const POLL: Duration = Duration::from_millis(10);

#[tokio::test]
async fn the_old_owner_leaves_its_successors_file_alone() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("plugin.sock");
    let (old_listener, old) = BoundSocket::bind(&path)?;
    assert!(old.in_place());
    drop(old_listener);
    let (_new_listener, new) = BoundSocket::bind(&path)?;
    assert!(!old.in_place(), "the successor's file is not the old one's");
    assert!(
        !old.remove()?,
        "the old owner must not remove its successor's file"
    );
    assert!(path.exists());
    assert!(served(&path).await);
    assert!(new.remove()?);
    assert!(!path.exists());
    Ok(())
}

#[tokio::test]
async fn a_successor_waits_until_nobody_answers() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("plugin.sock");
    assert!(matches!(
        wait_until_released(&path, Duration::from_secs(5), POLL).await,
        Released::Free(_)
    ));
    let (listener, old) = BoundSocket::bind(&path)?;
    assert_eq!(
        wait_until_released(&path, Duration::from_millis(50), POLL).await,
        Released::StillServed
    );
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(listener);
        old.remove()
    });
    match wait_until_released(&path, Duration::from_secs(10), POLL).await {
        Released::Free(waited) => assert!(waited > Duration::ZERO),
        Released::StillServed => anyhow::bail!("the path was released and still counted as served"),
    }
    assert!(release.await??);
    Ok(())
}
