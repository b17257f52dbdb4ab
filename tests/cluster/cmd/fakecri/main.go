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
	// The kubelet refuses an image without an id and a size; the fake's pulls have the
	// name as the id and this size.
	runtime.ImageService.SetFakeImageSize(1 << 20)
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
