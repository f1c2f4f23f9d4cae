"""What several test modules share: NIXL's presence, layouts, the fault injectors, the
two-process pair, fake HTTP servers and the soak. Test modules import from here, never from
one another."""
