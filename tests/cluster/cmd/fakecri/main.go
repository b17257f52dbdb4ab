// fakecri serves Kubernetes' own fake CRI runtime and image service on a unix
// socket. It runs in a process of its own, so its sandboxes and containers
// outlive a kubelet restart the way a real runtime's do.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"

	fake "k8s.io/cri-client/pkg/fake"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: fakecri unix:///path/to/socket")
		os.Exit(2)
	}
	runtime := fake.NewFakeRemoteRuntime()
	if err := runtime.Start(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
	fmt.Println("fakecri: serving", os.Args[1])
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
	runtime.Stop()
}
